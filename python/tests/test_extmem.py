"""register/export_pointer argument checks that need no GPU (the GPU paths run in
the container test on the GPU machine: scripts/containers/torch_export.py)."""

import pytest

import cudaipc
from cudaipc import extmem


def test_cpu_tensor_is_not_exportable():
    torch = pytest.importorskip("torch")
    with pytest.raises(cudaipc.NotExportable) as e:
        extmem.export_pointer(torch.zeros(4))
    assert "host memory" in str(e.value) and "\n" not in str(e.value)


def test_raw_pointer_needs_a_size():
    with pytest.raises(ValueError):
        extmem.export_pointer(0x7F0000000000)


def test_unknown_object():
    with pytest.raises(TypeError):
        extmem.export_pointer("not memory")


def test_not_exportable_message_names_the_fix():
    e = extmem.NotExportable(0x1000, "memory of a stream-ordered pool (cudaMallocAsync) without an IPC handle type", extmem.FIX_POOL)
    assert "expandable_segments:True" in str(e) and str(e).startswith("cudaipc: cannot export 0x1000")


def test_register_stages_descriptors_beyond_one_packet(store):
    """A registration of more pieces than one packet carries descriptors: the ones
    beyond MAX_FILES are staged first and the register finds all of them. Memfds stand
    in for VMM descriptors; this host-only daemon then refuses the GPU memory by its
    device, which it checks after the descriptor count (a short count would be refused
    as such), and the register took the staged ones with it."""
    import os
    from cudaipc import _store_pb2 as pb
    from cudaipc import extmem
    from cudaipc._wire import MAX_FILES
    from cudaipc.region import KIND_VMM_FD, VERSION_PIECES, Region, local_identity, parse_gpu_uuid
    n, piece = 2 * MAX_FILES + 5, 2 << 20
    ns, boot = local_identity()
    ids = [os.urandom(16) for _ in range(n)]
    region = Region(handle=bytes(64), offset=4096, size=n * piece - 8192, alloc_size=piece,
                    device=parse_gpu_uuid("GPU-5f1c2a3b-4d5e-6f70-8192-a3b4c5d6e7f8"),
                    exporter_pid=os.getpid(), pid_namespace=ns, boot_id=boot, buffer_id=0,
                    exporter_base=0x7f0000000000, kind=KIND_VMM_FD, version=VERSION_PIECES,
                    allocation_id=ids[0], more_pieces=tuple((i, piece) for i in ids[1:]))
    fds = [os.memfd_create("piece") for _ in range(n)]
    try:
        with pytest.raises(cudaipc.InvalidArgument) as e:
            extmem.send_register(store._conn, "torch/big", extmem.Export(region, fds), True)
        assert "no GPU backend" in str(e.value), str(e.value)
        # A count that does not add up is refused as such.
        store._conn.call(pb.Request(stage_files=pb.StageFilesRequest()), "register", "x", fds=fds[:5])
        req = extmem.register_request("torch/big", extmem.Export(region, fds), True)
        with pytest.raises(cudaipc.InvalidArgument) as e:
            store._conn.call(req, "register", "torch/big", fds=fds[:1])
        assert "6 were staged and attached" in str(e.value), str(e.value)
        # Nothing is left staged: the next stage starts from zero.
        rep = store._conn.call(pb.Request(stage_files=pb.StageFilesRequest()), "register", "x", fds=fds[:1])
        assert rep.resp.stage_files.staged == 1
    finally:
        for fd in fds:
            os.close(fd)
