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
