"""Stage artifacts load and run in a fresh interpreter that cannot import the user's model code."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import flatpack

REPO = Path(__file__).resolve().parents[2]

USER_MODEL = '''
import torch
from torch import nn

class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.inner = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        return self.norm(x + torch.nn.functional.gelu(self.inner(x)))

class UserModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.blocks = nn.Sequential(*(Block(16) for _ in range(4)))
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, tokens):
        return self.head(self.blocks(self.embed(tokens)))
'''

# Runs in the child: chains the stages from their manifests alone.
CHILD = '''
import importlib.abc, json, sys
from pathlib import Path

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {BLOCKED!r}:
            raise ImportError(f"{{name}} is blocked in this interpreter")
        return None

sys.meta_path.insert(0, Block())
import torch
from safetensors.torch import load_file
from flatpack.codegen import load_stage

out = Path({out!r})
data = load_file({data!r})
env = {{name: data[name] for name in json.loads(Path({names!r}).read_text())}}
stages = sorted(p for p in out.iterdir() if p.name.startswith("stage_"))
for directory in stages:
    stage = load_stage(directory)
    manifest = stage.flatpack_manifest
    outputs = stage(*(env[name] for name in manifest.input_names))
    env.update(zip(manifest.output_names, outputs))
final = [env[name] for name in json.loads((out / "flatpack.json").read_text())["output_names"]]
torch.testing.assert_close(final[0], data["expected"])
assert not any(name.split(".")[0] in {BLOCKED!r} for name in sys.modules), "user code was imported"
print("stages", len(stages), "ok")
'''


def run_child(tmp_path: Path, out: Path, inputs: dict, expected: torch.Tensor, blocked: list[str]) -> str:
    data = tmp_path / "io.safetensors"
    names = tmp_path / "names.json"
    save_file({**{k: v.contiguous() for k, v in inputs.items()}, "expected": expected.contiguous()}, data)
    names.write_text(__import__("json").dumps(list(inputs)))
    script = CHILD.format(out=str(out), data=str(data), names=str(names), BLOCKED=blocked)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(REPO)
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=tmp_path / "elsewhere",
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_user_model_stages_run_without_the_user_module(tmp_path):
    user_dir = tmp_path / "user"
    user_dir.mkdir()
    (tmp_path / "elsewhere").mkdir()
    (user_dir / "usermodel.py").write_text(USER_MODEL)
    spec = importlib.util.spec_from_file_location("usermodel", user_dir / "usermodel.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    model = module.UserModel().eval()
    tokens = torch.randint(0, 50, (3, 7))
    out = tmp_path / "out"
    compiled = flatpack.compile(model, (tokens,), stages=3, out_dir=out)
    assert compiled.frontend == "fx"
    # the tied embedding travels to both ends; the source names no user class
    sources = [(out / s / "stage.py").read_text() for s in compiled.info.stages]
    assert not any("usermodel" in text or "UserModel" in text for text in sources)
    inputs = {compiled.info.input_names[0]: tokens}
    stdout = run_child(tmp_path, out, inputs, model(tokens).detach(), ["usermodel"])
    assert "stages 3 ok" in stdout


@pytest.mark.slow
def test_bert_stages_run_without_transformers(tmp_path):
    pytest.importorskip("transformers")
    from flatpack.examples import bert

    (tmp_path / "elsewhere").mkdir()
    model, inputs = bert()
    out = tmp_path / "out"
    compiled = flatpack.compile(model, inputs, stages=3, out_dir=out)
    named = dict(zip(compiled.info.input_names, inputs.values()))
    stdout = run_child(tmp_path, out, named, model(**inputs).logits.detach(), ["transformers"])
    assert "stages 3 ok" in stdout
