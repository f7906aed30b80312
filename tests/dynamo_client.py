"""A Dynamo runtime client in a process of its own, for tests/test_dynamo.py: the runtime binds
to one event loop and lives for its process, so each use gets a fresh process.

    python tests/dynamo_client.py ENDPOINT_PATH INSTANCE_ID REQUEST_JSON [--stop-after N]

Sends REQUEST_JSON to that instance of the endpoint (DYN_FILE_KV names the discovery folder),
prints every response chunk as one JSON line; with --stop-after N, stops the request (Dynamo's
``stop_generating``, what the frontend does when its client goes away) after N chunks and
prints what still arrives.
"""

import argparse
import asyncio
import json

from dynamo.runtime import Context, DistributedRuntime


async def main(args: argparse.Namespace) -> None:
    runtime = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp")
    try:
        client = await runtime.endpoint(args.endpoint).client()
        await asyncio.wait_for(client.wait_for_instances(), 30)
        context = Context()
        stream = await client.direct(json.loads(args.request), args.instance, context=context)
        seen = 0
        async for item in stream:
            print(json.dumps(item.data() if callable(getattr(item, "data", None)) else item.data), flush=True)
            seen += 1
            if args.stop_after is not None and seen == args.stop_after:
                context.stop_generating()
    finally:
        runtime.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("endpoint")
    parser.add_argument("instance", type=int)
    parser.add_argument("request")
    parser.add_argument("--stop-after", type=int)
    asyncio.run(main(parser.parse_args()))
