"""Adapter folders from the admin API: malformed configs and paths are 400s (they were 500s), and the engine loads
exactly the folder that was validated (it reloaded the unresolved path, so a swapped symlink chose what ran)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from runtime.adapters.names import AdapterInvalid
from runtime.adapters.validation import base_shapes_of, validate_adapter
from tests.security._app import ADMIN, auth, served


@pytest.fixture(scope="module")
def good(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("lora") / "good"
    get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_path), LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def shapes(tiny_model_path: Path) -> dict[str, tuple[int, int]]:
    from transformers import AutoModelForCausalLM

    return base_shapes_of(AutoModelForCausalLM.from_pretrained(tiny_model_path))


def _edited(good: Path, tmp_path: Path, **changes) -> Path:
    a = Path(shutil.copytree(good, tmp_path / "a"))
    cfg = json.loads((a / "adapter_config.json").read_text())
    cfg.update(changes)
    (a / "adapter_config.json").write_text(json.dumps(cfg))  # json.dumps writes NaN/Infinity, as a hostile file would
    return a


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"lora_alpha": float("nan")}, "NaN is not a JSON value"),  # refused as the file is read: JSON has no NaN
        ({"lora_alpha": float("inf")}, "Infinity is not a JSON value"),
        ({"lora_alpha": 1e30}, "lora_alpha"),
        ({"lora_alpha": "8"}, "lora_alpha"),
        ({"alpha_pattern": {"q_proj": float("nan")}}, "NaN is not a JSON value"),
        ({"target_modules": "(unclosed"}, "target_modules"),
        ({"target_modules": "x" * 5000}, "target_modules"),
        ({"rank_pattern": {"[": 4}}, "rank_pattern"),
    ],
)
def test_malformed_configs_are_refused(good, shapes, tmp_path, changes, match):
    with pytest.raises(AdapterInvalid, match=match):
        validate_adapter(_edited(good, tmp_path, **changes), base_shapes=shapes, max_rank=16)


@pytest.mark.parametrize("path", ["a\x00b", "x" * 10_000, "/" + "d/" * 3000])
def test_malformed_paths_are_refused(shapes, path):
    with pytest.raises(AdapterInvalid):
        validate_adapter(Path(path), base_shapes=shapes, max_rank=16)


def test_the_api_answers_400_and_loads_the_validated_folder(good, tmp_path, tiny_model_path):
    root = tmp_path / "adapters"
    root.mkdir()
    real = Path(shutil.copytree(good, root / "real"))
    (root / "link").symlink_to(real)
    with served(tmp_path, tiny_model_path) as app:
        for bad in ("a\x00b", "x" * 10_000):
            r = app.post("/admin/adapters", json={"path": bad, "family": "f"}, headers=auth(ADMIN))
            assert r.status_code == 400, r.text[:300]
        r = app.post("/admin/adapters", json={"path": str(root / "link"), "family": "f"}, headers=auth(ADMIN))
        assert r.status_code == 200, r.text
        [loaded] = app.get("/admin/adapters", headers=auth(ADMIN)).json()["data"]
        assert loaded["path"] == str(real.resolve())  # what was validated is what the engine was given
