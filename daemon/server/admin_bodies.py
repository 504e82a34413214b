"""The bodies of kvd's admin calls (`/admin/...`), checked at the edge: a field of the wrong
type or shape is refused with a 400 that names it, before any operation sees it.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from .auth import TENANT_PATTERN
from .chat import Count, Number

# a tenant named in an admin request follows the token file's and X-KVD-Tenant's rule: a pin for
# a tenant no request can carry would hold blocks (and budget) nobody can hit
Tenant = Annotated[str, Field(pattern=TENANT_PATTERN.pattern)]


class PinRequest(BaseModel):
    text: str | None = None
    tokens: list[Count] | None = None
    # chat messages, rendered by the model's chat template without opening a reply: pinning a chat
    # system prompt this way pins the tokens every conversation that starts with it begins with
    messages: list[Any] | None = None
    chat_template_kwargs: Any = None  # with messages: as /v1/chat/completions takes them
    tools: Any = None  # with messages: as /v1/chat/completions takes them
    prefix: str | None = None  # an id from /admin/prefixes, instead of text or tokens
    # block keys (hex), as `GET /admin/pins?keys=true` lists another replica's pin: a copy of it
    # (kvd router's sync-pins), with its tenant and owner
    keys: Annotated[list[Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]], Field(min_length=1, max_length=65536)] \
        | None = None
    owner: str | None = None
    tenant: Tenant | None = None
    ttl: str | Number | None = None
    note: str = ""
    model: str | None = None  # with text, tokens or messages: a LoRA adapter's name, its own blocks
    # with keys: the LoRA adapter they were made under ("": the base model), as the replica they
    # come from knows it (kvd router's sync-pins), so that the copy knows when it is stranded
    adapter_id: Annotated[str, Field(pattern=r"^([0-9a-f]{64})?$")] | None = None


class EvictRequest(BaseModel):
    prefix: str | None = None
    # a prompt (a conversation, named by a request of it), as /admin/explain takes one; `tenant` is
    # then the namespace it is hashed in (default: the caller's), not the tenant to evict
    text: str | None = None
    tokens: list[Count] | None = None
    messages: list[Any] | None = None  # a chat request's messages, rendered as /v1/chat/completions renders them
    chat_template_kwargs: Any = None  # with messages: as /v1/chat/completions takes them
    tools: Any = None  # with messages: as /v1/chat/completions takes them
    tenant: Tenant | None = None
    # with a prompt: a LoRA adapter's name, its own blocks (default: the model's); alone: every
    # block of that adapter (or of the model itself, by its name)
    model: str | None = None
    # alone: every block hashed under the LoRA adapter of this digest (8 or more hex digits, as
    # `kvctl prefixes` and `kvctl status` show it), served or not: weights a reload replaced
    adapter_id: Annotated[str, Field(pattern=r"^[0-9a-f]{8,64}$")] | None = None
    model_revision: str | None = None
    all_unpinned: bool = False
    # set by kvd router, the same for every replica it sends the eviction to: of the replicas on
    # one shared Redis, only the first to claim it searches that Redis for other daemons' entries
    purge_once: Annotated[str, Field(pattern=r"^[0-9a-f]{16,64}$")] | None = None


class LoadLoraAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter, as vLLM takes it."""

    lora_name: str
    lora_path: str  # the PEFT adapter folder, an absolute path on kvd's machine
    load_inplace: StrictBool = False  # a name served already: new weights under it


class UnloadLoraAdapterRequest(BaseModel):
    """POST /v1/unload_lora_adapter, as vLLM takes it (its lora_int_id is accepted and unused)."""

    lora_name: str
    lora_int_id: int | None = None


class CancelRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    request_ids: Annotated[list[str], Field(min_length=1, max_length=1000)] | None = None
    tenant: Tenant | None = None


class ProfileStartRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_seconds: float = 30.0  # it stops by itself after this long (engine_profile.MAX_SECONDS_LIMIT at most)
    max_steps: int = 200  # or after this many engine steps, whichever comes first (MAX_STEPS_LIMIT at most)


class SleepRequest(BaseModel):
    """POST /admin/sleep (sleep_ops.py); `tags` as vLLM's and SGLang's (None: the cache and the weights)."""
    model_config = ConfigDict(extra="forbid")
    level: int = 1
    timeout: Number = 0.0  # seconds to wait for the requests in flight
    tags: list[str] | None = None


class WakeRequest(BaseModel):
    """POST /admin/wake and SGLang's /resume_memory_occupation (its /release_memory_occupation too)."""
    model_config = ConfigDict(extra="forbid")
    tags: list[str] | None = None


class WeightsRequest(BaseModel):
    """POST /admin/weights (weights_ops.py): the checkpoint folder whose weights serve next."""
    model_config = ConfigDict(extra="forbid")
    model_path: str
    timeout: Number = 60.0  # seconds to wait for the running requests to finish
    abort_running: StrictBool = False  # cancel them instead


class UpdateWeightsFromDiskRequest(BaseModel):
    """SGLang's POST /update_weights_from_disk. Its other fields (load_format, weight_version,
    flush_cache, ...) differ between its versions and change nothing here: kvd reads safetensors
    and always drops what the weights before computed (they are in the cache identity)."""
    model_config = ConfigDict(extra="ignore")
    model_path: str
    abort_all_requests: StrictBool = False


class DrainRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    drain: StrictBool = True


class VerifyRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rate: Number | None = Field(None, gt=0)  # bytes a second at most; None: tier_verify.DEFAULT_RATE
    unpaced: StrictBool = False  # as fast as the disk and a core allow (the engine then has less CPU)


class SwapRequest(BaseModel):
    prefix: str
    to: str
    keep_source: bool = Field(False, alias="copy")


class RolloutStart(BaseModel):
    policy: dict
    cohort: str | Number
    stops: list[str] = Field(default_factory=list)
    adr: Count | None = None
    baseline: str = "current"


class RolloutAdvance(BaseModel):
    to: str | Number


class RolloutRollback(BaseModel):
    reason: str


class CalibrateRequest(BaseModel):
    dtype: str = "fp8_e4m3"
    prompts: list[str | list[Count]] | None = None
    max_tokens: Count = Field(16, ge=0, le=256)
    max_kl: Number = Field(0.01, gt=0)
    margin: Number = 1.0
    slices: list[Count] = Field(default_factory=lambda: [512, 2048])
    if_older_than: Number | None = None
    apply: bool = False


class ResponsesPurge(BaseModel):
    tenant: Tenant | None = None  # this tenant's kept responses (None: any tenant's)
    older_than: str | Number | None = None  # those made longer ago than this (90, 30m, 7d)
    # these responses and conversations, by id (with tenant: that tenant's only)
    ids: Annotated[list[Annotated[str, Field(pattern=r"^(resp|conv)_[A-Za-z0-9_-]{1,128}$")]],
                   Field(min_length=1, max_length=10_000)] | None = None
    all: StrictBool = False  # every kept response (with neither tenant nor older_than)
    dry_run: StrictBool = False


class ReplyIdsRequest(BaseModel):
    """`POST /admin/reply-ids`: the ids kvd keeps of replies it gave `tenant`, by their text (a
    router's events view asks for those of the Responses answers it relays: router_replies.py)."""
    tenant: Tenant | None = None  # whose replies (None: the caller's)
    texts: Annotated[list[str], Field(min_length=1, max_length=64)]


class ExplainRequest(BaseModel):
    text: str | None = None
    tokens: list[Count] | None = None
    messages: list[Any] | None = None  # a chat, rendered as /v1/chat/completions renders it
    chat_template_kwargs: Any = None  # with messages: as /v1/chat/completions takes them
    tools: Any = None  # with messages: as /v1/chat/completions takes them
    # explain: OpenAI's, as a request sends it (explicit mode: cached up to its marked breakpoints alone)
    prompt_cache_options: Any = None
    tenant: Tenant | None = None
    model: str | None = None  # a LoRA adapter's name: its blocks (None, or the model's name: the model's)
    # route-facts: the request's own priority (vLLM's; it may defer itself under queue_order priority)
    priority: Count | None = None
    service_tier: Any = None  # route-facts: OpenAI's; "flex" defers it further (service_tiers.py)
