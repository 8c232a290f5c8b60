import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetNodeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetNodeResponse(_message.Message):
    __slots__ = ("node",)
    NODE_FIELD_NUMBER: _ClassVar[int]
    node: NodeInfo
    def __init__(self, node: _Optional[_Union[NodeInfo, _Mapping]] = ...) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("name", "address", "version", "draining", "sandboxes", "max_sandboxes", "checkpoints", "cpus", "cpu_load", "memory_available_bytes", "memory_total_bytes", "measured_at")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    SANDBOXES_FIELD_NUMBER: _ClassVar[int]
    MAX_SANDBOXES_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    CPUS_FIELD_NUMBER: _ClassVar[int]
    CPU_LOAD_FIELD_NUMBER: _ClassVar[int]
    MEMORY_AVAILABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEASURED_AT_FIELD_NUMBER: _ClassVar[int]
    name: str
    address: str
    version: str
    draining: bool
    sandboxes: int
    max_sandboxes: int
    checkpoints: int
    cpus: int
    cpu_load: float
    memory_available_bytes: int
    memory_total_bytes: int
    measured_at: _timestamp_pb2.Timestamp
    def __init__(self, name: _Optional[str] = ..., address: _Optional[str] = ..., version: _Optional[str] = ..., draining: _Optional[bool] = ..., sandboxes: _Optional[int] = ..., max_sandboxes: _Optional[int] = ..., checkpoints: _Optional[int] = ..., cpus: _Optional[int] = ..., cpu_load: _Optional[float] = ..., memory_available_bytes: _Optional[int] = ..., memory_total_bytes: _Optional[int] = ..., measured_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class DescribeCheckpointRequest(_message.Message):
    __slots__ = ("checkpoint_id",)
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    checkpoint_id: str
    def __init__(self, checkpoint_id: _Optional[str] = ...) -> None: ...

class DescribeCheckpointResponse(_message.Message):
    __slots__ = ("manifest",)
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    manifest: CheckpointManifest
    def __init__(self, manifest: _Optional[_Union[CheckpointManifest, _Mapping]] = ...) -> None: ...

class CheckpointManifest(_message.Message):
    __slots__ = ("checkpoint_id", "parent_id", "image", "image_digest", "layers", "shm", "labels", "created_at", "processes", "process_units", "images_digest", "images_bytes", "processes_why")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_ID_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    IMAGE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    PROCESS_UNITS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_DIGEST_FIELD_NUMBER: _ClassVar[int]
    IMAGES_BYTES_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_WHY_FIELD_NUMBER: _ClassVar[int]
    checkpoint_id: str
    parent_id: str
    image: str
    image_digest: str
    layers: _containers.RepeatedCompositeFieldContainer[LayerDescriptor]
    shm: LayerDescriptor
    labels: _containers.ScalarMap[str, str]
    created_at: _timestamp_pb2.Timestamp
    processes: int
    process_units: bytes
    images_digest: str
    images_bytes: int
    processes_why: str
    def __init__(self, checkpoint_id: _Optional[str] = ..., parent_id: _Optional[str] = ..., image: _Optional[str] = ..., image_digest: _Optional[str] = ..., layers: _Optional[_Iterable[_Union[LayerDescriptor, _Mapping]]] = ..., shm: _Optional[_Union[LayerDescriptor, _Mapping]] = ..., labels: _Optional[_Mapping[str, str]] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., processes: _Optional[int] = ..., process_units: _Optional[bytes] = ..., images_digest: _Optional[str] = ..., images_bytes: _Optional[int] = ..., processes_why: _Optional[str] = ...) -> None: ...

class LayerDescriptor(_message.Message):
    __slots__ = ("digest", "size_bytes")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    digest: str
    size_bytes: int
    def __init__(self, digest: _Optional[str] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class FetchLayerRequest(_message.Message):
    __slots__ = ("digest",)
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    digest: str
    def __init__(self, digest: _Optional[str] = ...) -> None: ...

class FetchLayerResponse(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class FetchImagesRequest(_message.Message):
    __slots__ = ("checkpoint_id",)
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    checkpoint_id: str
    def __init__(self, checkpoint_id: _Optional[str] = ...) -> None: ...

class FetchImagesResponse(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...
