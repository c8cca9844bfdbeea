"""msgpack control messages that carry tensors inline or as relay references.

Never pickle: tensors become msgpack ext types. Small ones (or all of them when no slab is given) travel
inline as `[u16 header length][msgpack [dtype, shape]][raw bytes]`; the rest are handed to the sender's
transport (an `ShmSlab`, a `RelayRouter`, or any ProducerTransport such as `DistSender`) and travel as its
reference (`ShmRef` / `DistRef` / `RemoteRef`), whose `slot_id` the receiver must ack to its owner.

NOTE: msgpack has one array type, so tuples come back as lists. numpy scalars are sent as Python
scalars.
"""

from __future__ import annotations

import struct
import threading
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np

from voice_server.relay.base import ConsumerTransport, ProducerTransport
from voice_server.relay.dist import DistRef
from voice_server.relay.mooncake import RemoteRef
from voice_server.relay.shm import ShmRef
from voice_server.relay.tensors import as_bytes_view, from_buffer, is_torch_tensor, to_numpy

if TYPE_CHECKING:
    import torch

EXT_INLINE_TENSOR = 1
EXT_SHM_REF = 2
EXT_DIST_REF = 3
EXT_REMOTE_REF = 4
RelayRef = ShmRef | DistRef | RemoteRef
_EXT_BY_REF: dict[type, int] = {ShmRef: EXT_SHM_REF, DistRef: EXT_DIST_REF, RemoteRef: EXT_REMOTE_REF}
_REF_BY_EXT: dict[int, type[ShmRef] | type[DistRef] | type[RemoteRef]] = {v: k for k, v in _EXT_BY_REF.items()}
DEFAULT_INLINE_THRESHOLD = 16384
_HEADER_LEN = struct.Struct("<H")
_local = threading.local()


def _packb_nested(obj: object) -> bytes:
    # NOTE: a fresh Packer mallocs a 256 KiB buffer; two alive at once (packb inside packb's default)
    # made glibc trim and refault the heap on every message (~50 us). One reused Packer per thread.
    packer = getattr(_local, "packer", None)
    if packer is None:
        packer = _local.packer = msgpack.Packer()
    return packer.pack(obj)


def encode_inline(x: np.ndarray | torch.Tensor) -> msgpack.ExtType:
    dtype, shape, raw = as_bytes_view(x)
    header = _packb_nested([dtype, list(shape)])
    return msgpack.ExtType(EXT_INLINE_TENSOR, b"".join((_HEADER_LEN.pack(len(header)), header, raw)))


def decode_inline(data: bytes, as_torch: bool) -> np.ndarray | torch.Tensor:
    (header_len,) = _HEADER_LEN.unpack_from(data)
    dtype, shape = msgpack.unpackb(data[_HEADER_LEN.size:_HEADER_LEN.size + header_len])
    raw: bytes | bytearray | memoryview = memoryview(data)[_HEADER_LEN.size + header_len:]
    if as_torch:
        # NOTE: torch needs writable memory; inline payloads are small, so one copy is cheap.
        raw = bytearray(raw)
    return from_buffer(raw, dtype, shape, as_torch)


def pack(
    obj: object, slab: ProducerTransport | None, consumer: str, inline_threshold: int = DEFAULT_INLINE_THRESHOLD,
    taken: list[int] | None = None,
) -> bytes:
    """Encode dicts/lists/tuples/scalars/str/bytes/None with tensors inline or in `slab` for `consumer`.
    The slots the message holds are appended to `taken`, for a caller that may drop the message unsent."""

    slot_ids: list[int] = []

    def default(x: Any) -> Any:
        if isinstance(x, np.ndarray) or is_torch_tensor(x):
            if slab is None or to_numpy(x)[1].nbytes < inline_threshold or slab.is_inline(consumer):
                return encode_inline(x)
            ref = slab.put(x, consumer)
            slot_ids.append(ref.slot_id)
            code = _EXT_BY_REF.get(type(ref))
            if code is None:
                raise TypeError(f"{type(slab).__name__}.put returned {type(ref).__name__}, not a relay reference")
            return msgpack.ExtType(code, _packb_nested(ref.to_wire()))
        if isinstance(x, np.generic):
            return x.item()
        raise TypeError(f"cannot encode {type(x).__name__} in a relay message")

    try:
        data = msgpack.packb(obj, default=default)
    except BaseException:
        if slab is not None:
            slab.discard(slot_ids)  # NOTE: the message is never sent, so nobody else would free these.
        raise
    if taken is not None:
        taken.extend(slot_ids)
    return data


class RelayReadError(Exception):
    """A well-formed message whose relayed tensor could not be read (segment gone, no descriptors).

    `obj` is the message with None in place of the unreadable tensors; `refs` are all its references,
    which must still be acked so the producer frees them.
    """

    def __init__(self, obj: object, refs: list[RelayRef], cause: BaseException) -> None:
        super().__init__(f"cannot read relayed tensor: {cause}")
        self.obj, self.refs, self.cause = obj, refs, cause


def unpack(
    data: bytes | memoryview, reader: ConsumerTransport | None, as_torch: bool = False
) -> tuple[object, list[RelayRef]]:
    """Decode a `pack` message; returns (object, refs whose slot_ids to ack once the tensors are unused).

    `reader` is an `ShmReader` (or the ConsumerTransport matching the sender's; `RelayReaders` for both
    ShmRef and RemoteRef). Shared-memory tensors are zero-copy views into the producer's slab: they must
    not be used after the ack; remote ones are copies the caller owns. Raises
    RelayReadError when a reference cannot be read, after decoding the rest.
    """
    refs: list[RelayRef] = []
    errors: list[BaseException] = []

    def ext_hook(code: int, payload: bytes) -> Any:
        if code == EXT_INLINE_TENSOR:
            return decode_inline(payload, as_torch)
        ref_type = _REF_BY_EXT.get(code)
        if ref_type is not None:
            ref = ref_type.from_wire(msgpack.unpackb(payload))
            if reader is None:
                raise ValueError(f"message carries a relayed tensor ({type(ref).__name__}) but no reader")
            refs.append(ref)
            try:
                return reader.get(ref, as_torch)
            except (OSError, ValueError) as exc:
                # NOTE: keep decoding, so the caller learns which request this was and all refs to ack.
                errors.append(exc)
                return None
        return msgpack.ExtType(code, payload)

    obj = msgpack.unpackb(data, ext_hook=ext_hook, raw=False, strict_map_key=False)
    if errors:
        raise RelayReadError(obj, refs, errors[0])
    return obj, refs
