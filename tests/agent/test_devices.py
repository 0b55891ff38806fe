"""Device discovery from the Ascend driver's files, with CPU devices as the fallback."""

from pathlib import Path

import pytest

from agent.devices import Device, NoDevicesError, discover_devices


def fake_host(tmp_path: Path, davinci: list[int], hccn: str | None) -> tuple[Path, Path]:
    dev = tmp_path / "dev"
    dev.mkdir()
    for i in davinci:
        (dev / f"davinci{i}").touch()
    (dev / "davinci_manager").touch()
    (dev / "hisi_hdc").touch()
    conf = tmp_path / "hccn.conf"
    if hccn is not None:
        conf.write_text(hccn)
    return dev, conf


def test_npus_with_their_roce_addresses(tmp_path: Path) -> None:
    dev, conf = fake_host(tmp_path, [1, 0, 10, 2], "address_0=192.168.100.101\nnetmask_0=255.255.255.0\n"
                          "address_1=192.168.101.101\naddress_2 = 192.168.102.101\n")
    devices = discover_devices(cpu_devices=0, dev_dir=dev, hccn_conf=conf)
    assert devices == [
        Device(0, "192.168.100.101", "npu"),
        Device(1, "192.168.101.101", "npu"),
        Device(2, "192.168.102.101", "npu"),
        Device(10, "", "npu"),
    ]


def test_npus_win_over_cpu_devices_and_missing_hccn_is_tolerated(tmp_path: Path) -> None:
    dev, conf = fake_host(tmp_path, [0], None)
    assert discover_devices(cpu_devices=4, dev_dir=dev, hccn_conf=conf) == [Device(0, "", "npu")]


def test_cpu_fallback(tmp_path: Path) -> None:
    dev, conf = fake_host(tmp_path, [], None)
    assert discover_devices(cpu_devices=2, dev_dir=dev, hccn_conf=conf) == [
        Device(0, "", "cpu"), Device(1, "", "cpu")]


def test_no_devices_is_a_clear_error(tmp_path: Path) -> None:
    dev, conf = fake_host(tmp_path, [], None)
    with pytest.raises(NoDevicesError, match="no Ascend devices under .* and no --cpu-devices"):
        discover_devices(cpu_devices=0, dev_dir=dev, hccn_conf=conf)


def test_npu_smi_when_dev_has_no_davinci(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dev, conf = fake_host(tmp_path, [], "address_1=10.1.1.1\n")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    smi = bindir / "npu-smi"
    smi.write_text("#!/bin/sh\n[ \"$1 $2\" = 'info -l' ] || exit 3\n"
                   "printf '        Total Count : 2\\n\\n        NPU ID : 1\\n        Product Name : X\\n\\n"
                   "        NPU ID : 0\\n'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:/usr/bin:/bin")
    assert discover_devices(cpu_devices=0, dev_dir=dev, hccn_conf=conf) == [
        Device(0, "", "npu"), Device(1, "10.1.1.1", "npu")]
