from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineConfig(_message.Message):
    __slots__ = ("model", "device", "dtype", "max_loras", "max_cpu_loras", "max_lora_rank", "max_model_len", "vllm_version", "kv_cache_bytes", "max_num_seqs", "model_name", "model_arg", "engine_args_json", "choices", "quantization")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_CPU_LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VLLM_VERSION_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_ARG_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    model: str
    device: str
    dtype: str
    max_loras: int
    max_cpu_loras: int
    max_lora_rank: int
    max_model_len: int
    vllm_version: str
    kv_cache_bytes: int
    max_num_seqs: int
    model_name: str
    model_arg: str
    engine_args_json: str
    choices: _containers.RepeatedCompositeFieldContainer[EngineChoice]
    quantization: str
    def __init__(self, model: _Optional[str] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., max_loras: _Optional[int] = ..., max_cpu_loras: _Optional[int] = ..., max_lora_rank: _Optional[int] = ..., max_model_len: _Optional[int] = ..., vllm_version: _Optional[str] = ..., kv_cache_bytes: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., model_name: _Optional[str] = ..., model_arg: _Optional[str] = ..., engine_args_json: _Optional[str] = ..., choices: _Optional[_Iterable[_Union[EngineChoice, _Mapping]]] = ..., quantization: _Optional[str] = ...) -> None: ...

class EngineChoice(_message.Message):
    __slots__ = ("name", "value", "why")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    WHY_FIELD_NUMBER: _ClassVar[int]
    name: str
    value: str
    why: str
    def __init__(self, name: _Optional[str] = ..., value: _Optional[str] = ..., why: _Optional[str] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("version", "pid", "socket", "home", "ready", "uptime_s", "engine_start_s", "engine", "requests_in_flight", "capacity", "http", "admission", "startup", "state")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    SOCKET_FIELD_NUMBER: _ClassVar[int]
    HOME_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    ENGINE_START_S_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    HTTP_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_FIELD_NUMBER: _ClassVar[int]
    STARTUP_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    version: str
    pid: int
    socket: str
    home: str
    ready: bool
    uptime_s: float
    engine_start_s: float
    engine: EngineConfig
    requests_in_flight: int
    capacity: Capacity
    http: str
    admission: Admission
    startup: Startup
    state: str
    def __init__(self, version: _Optional[str] = ..., pid: _Optional[int] = ..., socket: _Optional[str] = ..., home: _Optional[str] = ..., ready: _Optional[bool] = ..., uptime_s: _Optional[float] = ..., engine_start_s: _Optional[float] = ..., engine: _Optional[_Union[EngineConfig, _Mapping]] = ..., requests_in_flight: _Optional[int] = ..., capacity: _Optional[_Union[Capacity, _Mapping]] = ..., http: _Optional[str] = ..., admission: _Optional[_Union[Admission, _Mapping]] = ..., startup: _Optional[_Union[Startup, _Mapping]] = ..., state: _Optional[str] = ...) -> None: ...

class Startup(_message.Message):
    __slots__ = ("stage", "message", "done", "total", "unit", "detail", "elapsed_s", "eta_s")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    UNIT_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    ETA_S_FIELD_NUMBER: _ClassVar[int]
    stage: str
    message: str
    done: float
    total: float
    unit: str
    detail: str
    elapsed_s: float
    eta_s: float
    def __init__(self, stage: _Optional[str] = ..., message: _Optional[str] = ..., done: _Optional[float] = ..., total: _Optional[float] = ..., unit: _Optional[str] = ..., detail: _Optional[str] = ..., elapsed_s: _Optional[float] = ..., eta_s: _Optional[float] = ...) -> None: ...

class Admission(_message.Message):
    __slots__ = ("policy", "places", "pinned", "active", "queued", "max_wait_s", "requests", "adapters", "handover_s", "service_s", "mode", "mode_reason")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    PLACES_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    MAX_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    HANDOVER_S_FIELD_NUMBER: _ClassVar[int]
    SERVICE_S_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    MODE_REASON_FIELD_NUMBER: _ClassVar[int]
    policy: str
    places: int
    pinned: int
    active: int
    queued: int
    max_wait_s: float
    requests: _containers.RepeatedCompositeFieldContainer[RequestInfo]
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterQueue]
    handover_s: float
    service_s: float
    mode: str
    mode_reason: str
    def __init__(self, policy: _Optional[str] = ..., places: _Optional[int] = ..., pinned: _Optional[int] = ..., active: _Optional[int] = ..., queued: _Optional[int] = ..., max_wait_s: _Optional[float] = ..., requests: _Optional[_Iterable[_Union[RequestInfo, _Mapping]]] = ..., adapters: _Optional[_Iterable[_Union[AdapterQueue, _Mapping]]] = ..., handover_s: _Optional[float] = ..., service_s: _Optional[float] = ..., mode: _Optional[str] = ..., mode_reason: _Optional[str] = ...) -> None: ...

class AdmissionRequest(_message.Message):
    __slots__ = ("policy", "max_wait_s")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    MAX_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    policy: str
    max_wait_s: float
    def __init__(self, policy: _Optional[str] = ..., max_wait_s: _Optional[float] = ...) -> None: ...

class AdapterQueue(_message.Message):
    __slots__ = ("adapter", "running", "queued", "oldest_wait_s")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    OLDEST_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    running: int
    queued: int
    oldest_wait_s: float
    def __init__(self, adapter: _Optional[str] = ..., running: _Optional[int] = ..., queued: _Optional[int] = ..., oldest_wait_s: _Optional[float] = ...) -> None: ...

class RequestInfo(_message.Message):
    __slots__ = ("id", "adapter", "state", "position", "waited_s", "age_s")
    ID_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    WAITED_S_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    id: str
    adapter: str
    state: str
    position: int
    waited_s: float
    age_s: float
    def __init__(self, id: _Optional[str] = ..., adapter: _Optional[str] = ..., state: _Optional[str] = ..., position: _Optional[int] = ..., waited_s: _Optional[float] = ..., age_s: _Optional[float] = ...) -> None: ...

class Capacity(_message.Message):
    __slots__ = ("device_slots", "device_used", "host_slots", "host_used", "pins", "max_pins", "max_lora_rank", "disk_adapters", "disk_bytes", "device_pins", "max_device_pins")
    DEVICE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_USED_FIELD_NUMBER: _ClassVar[int]
    HOST_SLOTS_FIELD_NUMBER: _ClassVar[int]
    HOST_USED_FIELD_NUMBER: _ClassVar[int]
    PINS_FIELD_NUMBER: _ClassVar[int]
    MAX_PINS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    DISK_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_PINS_FIELD_NUMBER: _ClassVar[int]
    MAX_DEVICE_PINS_FIELD_NUMBER: _ClassVar[int]
    device_slots: int
    device_used: int
    host_slots: int
    host_used: int
    pins: int
    max_pins: int
    max_lora_rank: int
    disk_adapters: int
    disk_bytes: int
    device_pins: int
    max_device_pins: int
    def __init__(self, device_slots: _Optional[int] = ..., device_used: _Optional[int] = ..., host_slots: _Optional[int] = ..., host_used: _Optional[int] = ..., pins: _Optional[int] = ..., max_pins: _Optional[int] = ..., max_lora_rank: _Optional[int] = ..., disk_adapters: _Optional[int] = ..., disk_bytes: _Optional[int] = ..., device_pins: _Optional[int] = ..., max_device_pins: _Optional[int] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "seed", "stop", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "stop_token_ids", "ignore_eos", "logprobs", "structured")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    min_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    structured: StructuredOutputs
    def __init__(self, max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., min_p: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., structured: _Optional[_Union[StructuredOutputs, _Mapping]] = ...) -> None: ...

class StructuredOutputs(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "grammar")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: _containers.RepeatedScalarFieldContainer[str]
    grammar: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Iterable[str]] = ..., grammar: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "messages", "sampling", "lora")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    sampling: SamplingParams
    lora: str
    def __init__(self, prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., lora: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class GenerateReply(_message.Message):
    __slots__ = ("text", "token_ids", "prompt_token_ids", "finish_reason", "usage", "adapter", "logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    usage: Usage
    adapter: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., adapter: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class Logprob(_message.Message):
    __slots__ = ("token_id", "logprob", "text")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    text: str
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., text: _Optional[str] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "text", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    text: str
    top: _containers.RepeatedCompositeFieldContainer[Logprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., text: _Optional[str] = ..., top: _Optional[_Iterable[_Union[Logprob, _Mapping]]] = ...) -> None: ...

class GenerateManyRequest(_message.Message):
    __slots__ = ("id", "request", "cancel")
    ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    id: int
    request: GenerateRequest
    cancel: bool
    def __init__(self, id: _Optional[int] = ..., request: _Optional[_Union[GenerateRequest, _Mapping]] = ..., cancel: _Optional[bool] = ...) -> None: ...

class GenerationUpdate(_message.Message):
    __slots__ = ("id", "reply", "error_code", "error_message")
    ID_FIELD_NUMBER: _ClassVar[int]
    REPLY_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    id: int
    reply: GenerateReply
    error_code: int
    error_message: str
    def __init__(self, id: _Optional[int] = ..., reply: _Optional[_Union[GenerateReply, _Mapping]] = ..., error_code: _Optional[int] = ..., error_message: _Optional[str] = ...) -> None: ...

class GenerateManyReply(_message.Message):
    __slots__ = ("updates",)
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    updates: _containers.RepeatedCompositeFieldContainer[GenerationUpdate]
    def __init__(self, updates: _Optional[_Iterable[_Union[GenerationUpdate, _Mapping]]] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("ref", "name", "revision", "force", "hf_endpoint", "hf_token")
    REF_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    HF_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    HF_TOKEN_FIELD_NUMBER: _ClassVar[int]
    ref: str
    name: str
    revision: str
    force: bool
    hf_endpoint: str
    hf_token: str
    def __init__(self, ref: _Optional[str] = ..., name: _Optional[str] = ..., revision: _Optional[str] = ..., force: _Optional[bool] = ..., hf_endpoint: _Optional[str] = ..., hf_token: _Optional[str] = ...) -> None: ...

class PullProgress(_message.Message):
    __slots__ = ("stage", "file", "done_bytes", "total_bytes", "message", "adapter")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    DONE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    stage: str
    file: str
    done_bytes: int
    total_bytes: int
    message: str
    adapter: Adapter
    def __init__(self, stage: _Optional[str] = ..., file: _Optional[str] = ..., done_bytes: _Optional[int] = ..., total_bytes: _Optional[int] = ..., message: _Optional[str] = ..., adapter: _Optional[_Union[Adapter, _Mapping]] = ...) -> None: ...

class FileRecord(_message.Message):
    __slots__ = ("name", "size", "sha256")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    sha256: str
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class Adapter(_message.Message):
    __slots__ = ("name", "source", "ref", "revision", "base_model", "rank", "alpha", "target_modules", "size_bytes", "pulled_at", "files", "path", "hand_placed", "state", "error", "tier", "pinned", "slot", "last_used", "requests", "host_bytes", "pin", "normalized", "kind", "profile", "merge")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    REF_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PULLED_AT_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    HAND_PLACED_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    LAST_USED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    HOST_BYTES_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    NORMALIZED_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    MERGE_FIELD_NUMBER: _ClassVar[int]
    name: str
    source: str
    ref: str
    revision: str
    base_model: str
    rank: int
    alpha: float
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    size_bytes: int
    pulled_at: float
    files: _containers.RepeatedCompositeFieldContainer[FileRecord]
    path: str
    hand_placed: bool
    state: str
    error: str
    tier: str
    pinned: bool
    slot: int
    last_used: float
    requests: int
    host_bytes: int
    pin: str
    normalized: _containers.RepeatedScalarFieldContainer[str]
    kind: str
    profile: Profile
    merge: Merge
    def __init__(self, name: _Optional[str] = ..., source: _Optional[str] = ..., ref: _Optional[str] = ..., revision: _Optional[str] = ..., base_model: _Optional[str] = ..., rank: _Optional[int] = ..., alpha: _Optional[float] = ..., target_modules: _Optional[_Iterable[str]] = ..., size_bytes: _Optional[int] = ..., pulled_at: _Optional[float] = ..., files: _Optional[_Iterable[_Union[FileRecord, _Mapping]]] = ..., path: _Optional[str] = ..., hand_placed: _Optional[bool] = ..., state: _Optional[str] = ..., error: _Optional[str] = ..., tier: _Optional[str] = ..., pinned: _Optional[bool] = ..., slot: _Optional[int] = ..., last_used: _Optional[float] = ..., requests: _Optional[int] = ..., host_bytes: _Optional[int] = ..., pin: _Optional[str] = ..., normalized: _Optional[_Iterable[str]] = ..., kind: _Optional[str] = ..., profile: _Optional[_Union[Profile, _Mapping]] = ..., merge: _Optional[_Union[Merge, _Mapping]] = ...) -> None: ...

class Profile(_message.Message):
    __slots__ = ("base", "adapter", "digest", "adapters", "system", "template", "parameters", "messages", "license", "modelfile", "created_at")
    class ParametersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    BASE_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    LICENSE_FIELD_NUMBER: _ClassVar[int]
    MODELFILE_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    base: str
    adapter: str
    digest: str
    adapters: _containers.RepeatedCompositeFieldContainer[WeightedAdapter]
    system: str
    template: str
    parameters: _containers.ScalarMap[str, str]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    license: _containers.RepeatedScalarFieldContainer[str]
    modelfile: str
    created_at: float
    def __init__(self, base: _Optional[str] = ..., adapter: _Optional[str] = ..., digest: _Optional[str] = ..., adapters: _Optional[_Iterable[_Union[WeightedAdapter, _Mapping]]] = ..., system: _Optional[str] = ..., template: _Optional[str] = ..., parameters: _Optional[_Mapping[str, str]] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., license: _Optional[_Iterable[str]] = ..., modelfile: _Optional[str] = ..., created_at: _Optional[float] = ...) -> None: ...

class WeightedAdapter(_message.Message):
    __slots__ = ("name", "weight")
    NAME_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    name: str
    weight: float
    def __init__(self, name: _Optional[str] = ..., weight: _Optional[float] = ...) -> None: ...

class CreateRequest(_message.Message):
    __slots__ = ("name", "modelfile", "adapters", "system", "template", "parameters", "messages", "license", "force")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODELFILE_FIELD_NUMBER: _ClassVar[int]
    FROM_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    LICENSE_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    name: str
    modelfile: str
    adapters: _containers.RepeatedScalarFieldContainer[str]
    system: str
    template: str
    parameters: _containers.RepeatedScalarFieldContainer[str]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    license: _containers.RepeatedScalarFieldContainer[str]
    force: bool
    def __init__(self, name: _Optional[str] = ..., modelfile: _Optional[str] = ..., adapters: _Optional[_Iterable[str]] = ..., system: _Optional[str] = ..., template: _Optional[str] = ..., parameters: _Optional[_Iterable[str]] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., license: _Optional[_Iterable[str]] = ..., force: _Optional[bool] = ..., **kwargs) -> None: ...

class CopyRequest(_message.Message):
    __slots__ = ("source", "destination", "force")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    source: str
    destination: str
    force: bool
    def __init__(self, source: _Optional[str] = ..., destination: _Optional[str] = ..., force: _Optional[bool] = ...) -> None: ...

class Merge(_message.Message):
    __slots__ = ("method", "sources", "rank", "relative_error")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    RELATIVE_ERROR_FIELD_NUMBER: _ClassVar[int]
    method: str
    sources: _containers.RepeatedCompositeFieldContainer[MergeSource]
    rank: int
    relative_error: float
    def __init__(self, method: _Optional[str] = ..., sources: _Optional[_Iterable[_Union[MergeSource, _Mapping]]] = ..., rank: _Optional[int] = ..., relative_error: _Optional[float] = ...) -> None: ...

class MergeSource(_message.Message):
    __slots__ = ("name", "digest", "weight", "revision")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    name: str
    digest: str
    weight: float
    revision: str
    def __init__(self, name: _Optional[str] = ..., digest: _Optional[str] = ..., weight: _Optional[float] = ..., revision: _Optional[str] = ...) -> None: ...

class MergeRequest(_message.Message):
    __slots__ = ("name", "sources", "method", "svd_rank", "force")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    SVD_RANK_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    name: str
    sources: _containers.RepeatedCompositeFieldContainer[MergeSource]
    method: str
    svd_rank: int
    force: bool
    def __init__(self, name: _Optional[str] = ..., sources: _Optional[_Iterable[_Union[MergeSource, _Mapping]]] = ..., method: _Optional[str] = ..., svd_rank: _Optional[int] = ..., force: _Optional[bool] = ...) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ("json",)
    JSON_FIELD_NUMBER: _ClassVar[int]
    json: bool
    def __init__(self, json: _Optional[bool] = ...) -> None: ...

class ListReply(_message.Message):
    __slots__ = ("adapters", "json")
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    JSON_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[Adapter]
    json: str
    def __init__(self, adapters: _Optional[_Iterable[_Union[Adapter, _Mapping]]] = ..., json: _Optional[str] = ...) -> None: ...

class ShowRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class RemoveRequest(_message.Message):
    __slots__ = ("name", "force")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    name: str
    force: bool
    def __init__(self, name: _Optional[str] = ..., force: _Optional[bool] = ...) -> None: ...

class RemoveReply(_message.Message):
    __slots__ = ("adapter", "unloaded")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    UNLOADED_FIELD_NUMBER: _ClassVar[int]
    adapter: Adapter
    unloaded: bool
    def __init__(self, adapter: _Optional[_Union[Adapter, _Mapping]] = ..., unloaded: _Optional[bool] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ("name", "to")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TO_FIELD_NUMBER: _ClassVar[int]
    name: str
    to: str
    def __init__(self, name: _Optional[str] = ..., to: _Optional[str] = ...) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    FROM_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ..., **kwargs) -> None: ...

class NameRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("name", "to")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TO_FIELD_NUMBER: _ClassVar[int]
    name: str
    to: str
    def __init__(self, name: _Optional[str] = ..., to: _Optional[str] = ...) -> None: ...

class EventsRequest(_message.Message):
    __slots__ = ("history",)
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    history: int
    def __init__(self, history: _Optional[int] = ...) -> None: ...

class LifecycleEvent(_message.Message):
    __slots__ = ("kind", "adapter", "reason", "message", "time")
    KIND_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    kind: str
    adapter: str
    reason: str
    message: str
    time: float
    def __init__(self, kind: _Optional[str] = ..., adapter: _Optional[str] = ..., reason: _Optional[str] = ..., message: _Optional[str] = ..., time: _Optional[float] = ...) -> None: ...

class MetricsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MetricsReply(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...
