"""The daemon's core: :class:`~loractld.core.core.Core` (its operations, for every door) and the
policy that decides who may change state (:mod:`loractld.core.policy`). The names below are the
ones the doors take from here."""

from loractld.core import policy  # noqa: F401
from loractld.core.core import Core  # noqa: F401
from loractld.core.state import Catalog  # noqa: F401
from loractld.engine.sampling import DEFAULT_MAX_TOKENS, Delta, Sampling, Structured, TokenLogprob  # noqa: F401
from loractld.generation import GenerationRequest, Prepared, UnknownModel  # noqa: F401
