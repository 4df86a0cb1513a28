from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LookupRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("present", "tier", "prefix_len")
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    PREFIX_LEN_FIELD_NUMBER: _ClassVar[int]
    present: _containers.RepeatedScalarFieldContainer[bool]
    tier: _containers.RepeatedScalarFieldContainer[str]
    prefix_len: int
    def __init__(self, present: _Optional[_Iterable[bool]] = ..., tier: _Optional[_Iterable[str]] = ..., prefix_len: _Optional[int] = ...) -> None: ...

class PutHeader(_message.Message):
    __slots__ = ("key", "total_bytes", "num_frames")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    total_bytes: int
    num_frames: int
    def __init__(self, key: _Optional[bytes] = ..., total_bytes: _Optional[int] = ..., num_frames: _Optional[int] = ...) -> None: ...

class PutFrame(_message.Message):
    __slots__ = ("seq", "header", "data")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    seq: int
    header: PutHeader
    data: bytes
    def __init__(self, seq: _Optional[int] = ..., header: _Optional[_Union[PutHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("stored",)
    STORED_FIELD_NUMBER: _ClassVar[int]
    stored: bool
    def __init__(self, stored: _Optional[bool] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    def __init__(self, key: _Optional[bytes] = ...) -> None: ...

class GetManyRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class SegmentFrame(_message.Message):
    __slots__ = ("index", "kind", "layer", "data", "total_bytes", "tier")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        HEADER: _ClassVar[SegmentFrame.Kind]
        LAYER: _ClassVar[SegmentFrame.Kind]
        MISS: _ClassVar[SegmentFrame.Kind]
    HEADER: SegmentFrame.Kind
    LAYER: SegmentFrame.Kind
    MISS: SegmentFrame.Kind
    INDEX_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    index: int
    kind: SegmentFrame.Kind
    layer: int
    data: bytes
    total_bytes: int
    tier: str
    def __init__(self, index: _Optional[int] = ..., kind: _Optional[_Union[SegmentFrame.Kind, str]] = ..., layer: _Optional[int] = ..., data: _Optional[bytes] = ..., total_bytes: _Optional[int] = ..., tier: _Optional[str] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, deleted: _Optional[_Iterable[bool]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("name", "count", "used_bytes", "capacity_bytes", "hits", "misses", "evictions", "errors")
    NAME_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    name: str
    count: int
    used_bytes: int
    capacity_bytes: int
    hits: int
    misses: int
    evictions: int
    errors: int
    def __init__(self, name: _Optional[str] = ..., count: _Optional[int] = ..., used_bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., errors: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("namespace", "tiers", "lookups", "puts", "gets", "bytes_in", "bytes_out", "hints")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    PUTS_FIELD_NUMBER: _ClassVar[int]
    GETS_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    HINTS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    lookups: int
    puts: int
    gets: int
    bytes_in: int
    bytes_out: int
    hints: HintStats
    def __init__(self, namespace: _Optional[str] = ..., tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., lookups: _Optional[int] = ..., puts: _Optional[int] = ..., gets: _Optional[int] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., hints: _Optional[_Union[HintStats, _Mapping]] = ...) -> None: ...

class HintStats(_message.Message):
    __slots__ = ("tagged", "pinned", "pending")
    TAGGED_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    tagged: int
    pinned: int
    pending: int
    def __init__(self, tagged: _Optional[int] = ..., pinned: _Optional[int] = ..., pending: _Optional[int] = ...) -> None: ...

class DataPlaneRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DataPlaneResponse(_message.Message):
    __slots__ = ("unix_socket", "region_bytes", "tcp_port")
    UNIX_SOCKET_FIELD_NUMBER: _ClassVar[int]
    REGION_BYTES_FIELD_NUMBER: _ClassVar[int]
    TCP_PORT_FIELD_NUMBER: _ClassVar[int]
    unix_socket: str
    region_bytes: int
    tcp_port: int
    def __init__(self, unix_socket: _Optional[str] = ..., region_bytes: _Optional[int] = ..., tcp_port: _Optional[int] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("stored",)
    STORED_FIELD_NUMBER: _ClassVar[int]
    stored: bool
    def __init__(self, stored: _Optional[bool] = ...) -> None: ...

class Stored(_message.Message):
    __slots__ = ("key", "parent", "tokens")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    parent: bytes
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, key: _Optional[bytes] = ..., parent: _Optional[bytes] = ..., tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class Removed(_message.Message):
    __slots__ = ("key", "reason", "tier")
    KEY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    reason: str
    tier: str
    def __init__(self, key: _Optional[bytes] = ..., reason: _Optional[str] = ..., tier: _Optional[str] = ...) -> None: ...

class WatchEvent(_message.Message):
    __slots__ = ("removed", "dropped", "stored")
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    removed: _containers.RepeatedCompositeFieldContainer[Removed]
    dropped: int
    stored: _containers.RepeatedCompositeFieldContainer[Stored]
    def __init__(self, removed: _Optional[_Iterable[_Union[Removed, _Mapping]]] = ..., dropped: _Optional[int] = ..., stored: _Optional[_Iterable[_Union[Stored, _Mapping]]] = ...) -> None: ...

class HintRequest(_message.Message):
    __slots__ = ("hint_json", "keys", "pin_ttl_s", "prefetch")
    HINT_JSON_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PIN_TTL_S_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_FIELD_NUMBER: _ClassVar[int]
    hint_json: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    pin_ttl_s: float
    prefetch: bool
    def __init__(self, hint_json: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., pin_ttl_s: _Optional[float] = ..., prefetch: _Optional[bool] = ...) -> None: ...

class HintResponse(_message.Message):
    __slots__ = ("tagged", "pinned", "prefetching")
    TAGGED_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    PREFETCHING_FIELD_NUMBER: _ClassVar[int]
    tagged: int
    pinned: int
    prefetching: int
    def __init__(self, tagged: _Optional[int] = ..., pinned: _Optional[int] = ..., prefetching: _Optional[int] = ...) -> None: ...
