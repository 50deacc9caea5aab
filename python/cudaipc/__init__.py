"""cudaipc: zero-copy sharing of GPU and host memory between processes.

A client of the cudaipc store daemon (``cudaipc serve``)::

    import cudaipc
    with cudaipc.connect() as store:                 # $CUDAIPC_SOCKET or the default path
        store.put("w0", weights)                     # a torch.Tensor, CuPy/NumPy array or bytes
        with store.get("w0", timeout=5) as lease:
            t = lease.tensor()                       # zero-copy, on the object's device

and CUDA IPC regions of PyTorch and CuPy memory without the store::

    r = cudaipc.Region.from_torch(t)                 # send r.to_json() or r.to_bytes()
    m = cudaipc.import_region(r)                     # in another process
    t2 = m.tensor(torch.float32, (1024,))

Lifetimes: memory stays leased (or mapped) while the Lease (or Mapping) or any view
made from it is alive, even after ``release()`` or the end of a ``with`` block.
GPU work goes through NVIDIA's cuda-bindings, imported only when a GPU object is
touched; host objects need only protobuf (NumPy for numpy() and tensor()).
"""

from ._deps import require as _require

_require("google.protobuf", "import cudaipc")   # the wire format: say what to install, not "No module named 'google'"

from .errors import (Closed, CudaError, CudaipcError, DataLossError, Exists, InternalError,
                     InvalidArgument, InvalidRegion, LimitReached, NotFound, NotSealed,
                     PermissionDenied, Sealed, StoreError, StoreFull, StoreGone, Timeout,
                     UnavailableError, VersionMismatch)
from .extmem import NotExportable, export_pointer
from .info import (SHARE_CUDA_IPC, SHARE_HOST, SHARE_VMM_FD, Event, ObjectInfo, ServerInfo,
                   TensorDesc)
from .lease import Lease, Object
from .mapping import Mapping, import_region
from .region import Region, decode_region
from .store import Store, connect, default_socket_path, share
from ._deps import MissingDependency
from . import bundle
from . import kv
from .bundle import Bundle, LoadMismatch, LoadReport, load_into

__version__ = "0.1.0"

__all__ = [
    "connect", "default_socket_path", "Store", "Lease", "Object", "ObjectInfo", "TensorDesc",
    "Event", "ServerInfo", "Region", "decode_region", "import_region", "Mapping",
    "CudaipcError", "StoreError", "InvalidArgument", "NotFound", "Exists", "Timeout", "StoreFull",
    "PermissionDenied", "LimitReached", "NotSealed", "Sealed", "VersionMismatch", "InternalError",
    "UnavailableError", "DataLossError", "StoreGone", "Closed", "InvalidRegion", "CudaError", "MissingDependency",
    "share", "export_pointer", "NotExportable", "SHARE_HOST", "SHARE_CUDA_IPC", "SHARE_VMM_FD",
    "bundle", "kv", "Bundle", "LoadMismatch", "LoadReport", "load_into",
]
