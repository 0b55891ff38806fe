"""Which devices this host trains on: Ascend NPUs from the driver, or configured CPU devices."""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

_DAVINCI = re.compile(r"^davinci(\d+)$")
_HCCN_ADDRESS = re.compile(r"^address_(\d+)\s*=\s*(\S+)\s*$")
_NPU_SMI_ID = re.compile(r"^\s*NPU ID\s*:\s*(\d+)\s*$", re.MULTILINE)
NPU_SMI_TIMEOUT_S = 10


@dataclass(frozen=True)
class Device:
    device_id: int
    device_ip: str  # empty when unknown (CPU devices, or no hccn.conf entry)
    kind: str  # "npu" or "cpu"


class NoDevicesError(Exception):
    pass


def npu_device_ids(dev_dir: Path) -> list[int]:
    """Device ids from /dev/davinciN (davinci_manager and friends are not devices)."""
    if not dev_dir.is_dir():
        return []
    ids = [int(m.group(1)) for p in dev_dir.iterdir() if (m := _DAVINCI.match(p.name))]
    return sorted(ids)


def npu_smi_device_ids() -> list[int]:
    """Device ids from `npu-smi info -l`, for hosts whose driver exposes no /dev/davinciN to us."""
    binary = shutil.which("npu-smi")
    if binary is None:
        return []
    try:
        out = subprocess.run([binary, "info", "-l"], capture_output=True, text=True, timeout=NPU_SMI_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if out.returncode != 0:
        return []
    return sorted({int(m) for m in _NPU_SMI_ID.findall(out.stdout)})


def hccn_device_ips(hccn_conf: Path) -> dict[int, str]:
    """`address_N=IP` lines of /etc/hccn.conf: the RoCE address of each NPU, for the rank table."""
    try:
        text = hccn_conf.read_text()
    except (FileNotFoundError, PermissionError):
        return {}
    ips = {}
    for line in text.splitlines():
        match = _HCCN_ADDRESS.match(line.strip())
        if match:
            ips[int(match.group(1))] = match.group(2)
    return ips


def discover_devices(*, cpu_devices: int, dev_dir: Path, hccn_conf: Path) -> list[Device]:
    """NPUs when the host has them (/dev/davinciN, else `npu-smi`); otherwise `cpu_devices` CPU devices."""
    ids = npu_device_ids(dev_dir) or npu_smi_device_ids()
    if ids:
        ips = hccn_device_ips(hccn_conf)
        return [Device(i, ips.get(i, ""), "npu") for i in ids]
    if cpu_devices > 0:
        return [Device(i, "", "cpu") for i in range(cpu_devices)]
    raise NoDevicesError(f"no Ascend devices under {dev_dir} and no --cpu-devices given")
