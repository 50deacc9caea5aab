"""Naming a device as the protocol does: "" for host memory, a GPU UUID for a GPU."""

from __future__ import annotations

import re
from typing import Any, Dict

from . import _cuda
from .errors import InvalidArgument
from .region import gpu_uuid_text, parse_gpu_uuid

__all__ = ["resolve_device", "is_host"]

_ordinal_uuid: Dict[int, str] = {}   # GPU ordinal -> its UUID text (the ordinals of a process do not change)


def is_host(device: Any) -> bool:
    """Whether ``device`` names host memory (None, "host", "", a CPU torch.device)."""
    if device is None or device == "host" or device == "":
        return True
    return type(device).__module__.startswith("torch") and getattr(device, "type", None) == "cpu"


def resolve_device(device: Any) -> str:
    """The protocol's device string of ``device``: None, "host" or "" (host memory), a
    GPU ordinal, "cuda:N", a torch.device, or a GPU UUID."""
    if device is None or device == "host" or device == "":
        return ""
    if type(device) is int and device in _ordinal_uuid:
        return _ordinal_uuid[device]
    if type(device).__module__.startswith("torch") and hasattr(device, "type"):  # torch.device
        if device.type == "cpu":
            return ""
        device = device.index if device.index is not None else 0
    if isinstance(device, str) and re.fullmatch(r"cuda(:\d+)?", device):
        device = int(device[5:] or 0)
    if isinstance(device, str) and device.lstrip("-").isdigit():
        device = int(device)
    if isinstance(device, int) and not isinstance(device, bool):
        us = _cuda.uuids()
        if not 0 <= device < len(us):
            raise InvalidArgument("create", "", "GPU ordinal %d: this process sees %d GPUs" % (device, len(us)))
        text = _ordinal_uuid[device] = gpu_uuid_text(us[device])
        return text
    if isinstance(device, str):
        try:
            return gpu_uuid_text(parse_gpu_uuid(device))
        except ValueError:
            pass
    raise InvalidArgument("create", "", "device %r: want None or 'host', a GPU ordinal, 'cuda:N' or a GPU UUID" % (device,))
