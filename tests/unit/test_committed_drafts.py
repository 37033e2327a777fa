"""Committed drafts are stored xz-compressed and unpacked once into the cache."""

import json

from specfw.committed_drafts import committed_draft, pack_draft


def test_pack_then_unpack_round_trips_and_is_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECFW_CACHE_DIR", str(tmp_path / "cache"))
    d = tmp_path / "plugin" / "demo_draft"
    d.mkdir(parents=True)
    weights = bytes(range(256)) * 8192  # 2 MB: packed
    (d / "model.safetensors").write_bytes(weights)
    (d / "config.json").write_text(json.dumps({"hidden_size": 8}))  # small: left as it is
    assert committed_draft(d) == d  # nothing packed yet: the directory itself
    assert [p.name for p in pack_draft(d)] == ["model.safetensors.xz"]
    assert not (d / "model.safetensors").exists() and (d / "config.json").exists()
    out = committed_draft(d)
    assert out != d and out.parent == tmp_path / "cache" / "drafts" and out.name.startswith("plugin-")
    assert (out / "model.safetensors").read_bytes() == weights and json.loads((out / "config.json").read_text()) == {"hidden_size": 8}
    (out / "model.safetensors").write_bytes(b"touched")
    assert committed_draft(d) == out and (out / "model.safetensors").read_bytes() == b"touched"  # unpacked once, then reused


def test_the_committed_demo_drafts_are_packed_and_unpack():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "plugins"
    for kind in ("eagle", "eagle3", "mtp", "standalone"):
        d = root / kind / "demo_draft"
        assert (d / "model.safetensors.xz").exists() and not (d / "model.safetensors").exists(), kind
        assert (committed_draft(d) / "model.safetensors").stat().st_size > 1 << 20


def test_demo_draft_for_serves_only_the_demo_target(tmp_path):
    from pathlib import Path
    from types import SimpleNamespace

    from specfw.committed_drafts import demo_draft_for

    def ctx(path):
        return SimpleNamespace(engine_config=SimpleNamespace(model=SimpleNamespace(path=path)))

    eagle3 = Path(__file__).resolve().parents[2] / "plugins" / "eagle3" / "demo_draft"
    assert (demo_draft_for(ctx(None), eagle3) / "model.safetensors").exists()
    assert demo_draft_for(ctx("demo"), eagle3) == demo_draft_for(ctx(""), eagle3)
    assert demo_draft_for(ctx("/models/llama"), eagle3) is None  # another target: no demo draft
    assert demo_draft_for(ctx(None), tmp_path) is None  # a plugin that ships none
