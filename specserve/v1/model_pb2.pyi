from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_name", "architecture", "vocab_size", "eos_token_ids", "max_context", "tokenizer_json", "vocab_fingerprint", "attention", "dtype", "prefix_block_tokens")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_JSON_FIELD_NUMBER: _ClassVar[int]
    VOCAB_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    architecture: str
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_context: int
    tokenizer_json: str
    vocab_fingerprint: str
    attention: str
    dtype: str
    prefix_block_tokens: int
    def __init__(self, model_name: _Optional[str] = ..., architecture: _Optional[str] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_context: _Optional[int] = ..., tokenizer_json: _Optional[str] = ..., vocab_fingerprint: _Optional[str] = ..., attention: _Optional[str] = ..., dtype: _Optional[str] = ..., prefix_block_tokens: _Optional[int] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class GroupSpec(_message.Message):
    __slots__ = ("group_id", "prompt_token_ids", "sequence_ids", "sampling", "max_new_tokens", "logprobs")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    group_id: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sequence_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    max_new_tokens: int
    logprobs: bool
    def __init__(self, group_id: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sequence_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., max_new_tokens: _Optional[int] = ..., logprobs: _Optional[bool] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("batch_id", "groups")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    groups: _containers.RepeatedCompositeFieldContainer[GroupSpec]
    def __init__(self, batch_id: _Optional[str] = ..., groups: _Optional[_Iterable[_Union[GroupSpec, _Mapping]]] = ...) -> None: ...

class SequenceToken(_message.Message):
    __slots__ = ("sequence_id", "token_id", "logprob")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    sequence_id: int
    token_id: int
    logprob: float
    def __init__(self, sequence_id: _Optional[int] = ..., token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_tokens", "kv_bytes", "cached_tokens")
    FIRST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    first_tokens: _containers.RepeatedCompositeFieldContainer[SequenceToken]
    kv_bytes: int
    cached_tokens: _containers.RepeatedCompositeFieldContainer[GroupCachedTokens]
    def __init__(self, first_tokens: _Optional[_Iterable[_Union[SequenceToken, _Mapping]]] = ..., kv_bytes: _Optional[int] = ..., cached_tokens: _Optional[_Iterable[_Union[GroupCachedTokens, _Mapping]]] = ...) -> None: ...

class GroupCachedTokens(_message.Message):
    __slots__ = ("group_id", "tokens")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    group_id: int
    tokens: int
    def __init__(self, group_id: _Optional[int] = ..., tokens: _Optional[int] = ...) -> None: ...

class SequenceUpdate(_message.Message):
    __slots__ = ("sequence_id", "accepted_len", "next_token_id", "catch_up_token_ids")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_LEN_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    CATCH_UP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    sequence_id: int
    accepted_len: int
    next_token_id: int
    catch_up_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, sequence_id: _Optional[int] = ..., accepted_len: _Optional[int] = ..., next_token_id: _Optional[int] = ..., catch_up_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("batch_id", "updates", "draft_len", "release_sequence_ids")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_LEN_FIELD_NUMBER: _ClassVar[int]
    RELEASE_SEQUENCE_IDS_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    updates: _containers.RepeatedCompositeFieldContainer[SequenceUpdate]
    draft_len: int
    release_sequence_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, batch_id: _Optional[str] = ..., updates: _Optional[_Iterable[_Union[SequenceUpdate, _Mapping]]] = ..., draft_len: _Optional[int] = ..., release_sequence_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DraftDistribution(_message.Message):
    __slots__ = ("token_ids", "probs_fp16")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FP16_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs_fp16: bytes
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., probs_fp16: _Optional[bytes] = ...) -> None: ...

class Proposal(_message.Message):
    __slots__ = ("sequence_id", "token_ids", "distributions")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DISTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    sequence_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    distributions: _containers.RepeatedCompositeFieldContainer[DraftDistribution]
    def __init__(self, sequence_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., distributions: _Optional[_Iterable[_Union[DraftDistribution, _Mapping]]] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("proposals", "kv_bytes")
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    proposals: _containers.RepeatedCompositeFieldContainer[Proposal]
    kv_bytes: int
    def __init__(self, proposals: _Optional[_Iterable[_Union[Proposal, _Mapping]]] = ..., kv_bytes: _Optional[int] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("batch_id", "proposals", "release_sequence_ids")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_SEQUENCE_IDS_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    proposals: _containers.RepeatedCompositeFieldContainer[Proposal]
    release_sequence_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, batch_id: _Optional[str] = ..., proposals: _Optional[_Iterable[_Union[Proposal, _Mapping]]] = ..., release_sequence_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Verdict(_message.Message):
    __slots__ = ("sequence_id", "accepted_len", "next_token_id", "logprobs")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_LEN_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    sequence_id: int
    accepted_len: int
    next_token_id: int
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, sequence_id: _Optional[int] = ..., accepted_len: _Optional[int] = ..., next_token_id: _Optional[int] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("verdicts", "kv_bytes")
    VERDICTS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    verdicts: _containers.RepeatedCompositeFieldContainer[Verdict]
    kv_bytes: int
    def __init__(self, verdicts: _Optional[_Iterable[_Union[Verdict, _Mapping]]] = ..., kv_bytes: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("batch_id", "sequence_ids")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_IDS_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    sequence_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, batch_id: _Optional[str] = ..., sequence_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released_sequences",)
    RELEASED_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    released_sequences: int
    def __init__(self, released_sequences: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelStats(_message.Message):
    __slots__ = ("batches", "sequences", "kv_bytes", "kv_reserved_bytes", "kv_budget_bytes", "prefix_cache_bytes", "prefix_cache_spans", "prefix_cache_lookup_tokens", "prefix_cache_hit_tokens", "prefix_cache_refs")
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_SPANS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_LOOKUP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_REFS_FIELD_NUMBER: _ClassVar[int]
    batches: int
    sequences: int
    kv_bytes: int
    kv_reserved_bytes: int
    kv_budget_bytes: int
    prefix_cache_bytes: int
    prefix_cache_spans: int
    prefix_cache_lookup_tokens: int
    prefix_cache_hit_tokens: int
    prefix_cache_refs: int
    def __init__(self, batches: _Optional[int] = ..., sequences: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., kv_reserved_bytes: _Optional[int] = ..., kv_budget_bytes: _Optional[int] = ..., prefix_cache_bytes: _Optional[int] = ..., prefix_cache_spans: _Optional[int] = ..., prefix_cache_lookup_tokens: _Optional[int] = ..., prefix_cache_hit_tokens: _Optional[int] = ..., prefix_cache_refs: _Optional[int] = ...) -> None: ...
