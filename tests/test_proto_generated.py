"""The committed generated modules must match what `make proto` produces from the .proto files."""

from pathlib import Path

from proto.generate import REPO_ROOT, generate


def test_generated_modules_are_current(tmp_path: Path) -> None:
    (tmp_path / "proto").mkdir()
    sources = generate(out_dir=tmp_path)
    assert sources, "no .proto sources found"
    fresh = sorted(p.name for p in (tmp_path / "proto").iterdir())
    assert fresh, "protoc produced nothing"
    for name in fresh:
        committed = REPO_ROOT / "proto" / name
        assert committed.exists(), f"proto/{name} is not committed; run `make proto`"
        assert committed.read_bytes() == (tmp_path / "proto" / name).read_bytes(), (
            f"proto/{name} is stale; run `make proto` and commit the result"
        )
