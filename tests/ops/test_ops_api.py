"""The public op surface: ``hf_varlen.ops`` exports every op lazily, so hf_varlen imports without
triton (the ops themselves need it)."""

from __future__ import annotations

import subprocess
import sys

import hf_varlen
import hf_varlen.ops as ops

_NO_TRITON = """
import sys

class _NoTriton:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("triton is not installed (blocked by the test)")

sys.meta_path.insert(0, _NoTriton())
import hf_varlen, hf_varlen.ops, hf_varlen.ops.common
from hf_varlen import install_fused_cross_entropy, kernelize, KernelizeReport
assert "triton" not in sys.modules, sorted(m for m in sys.modules if m.startswith("triton"))
hf_varlen.ops.lora_linear  # torch only: resolves without triton
assert "triton" not in sys.modules
try:
    hf_varlen.ops.swiglu
except ImportError as exc:
    assert "triton" in str(exc)
else:
    raise AssertionError("swiglu resolved without triton")
print("ok")
"""


def test_every_export_resolves():
    from hf_varlen.ops import attention, cross_entropy, glu, lora, rmsnorm, rope

    expected = {
        "apply_rotary_qk": rope.apply_rotary_qk,
        "rotary_pos_emb": rope.rotary_pos_emb,
        "swiglu": glu.swiglu,
        "geglu": glu.geglu,
        "rms_norm": rmsnorm.rms_norm,
        "fused_linear_cross_entropy": cross_entropy.fused_linear_cross_entropy,
        "lora_linear": lora.lora_linear,
        "triton_varlen_attention": attention.triton_varlen_attention,
    }
    assert sorted(ops.__all__) == sorted(expected)
    for name, fn in expected.items():
        assert getattr(ops, name) is fn
    assert set(ops.__all__) <= set(dir(ops))


def test_top_level_loss_and_kernelize_names():
    from hf_varlen.integrations import fused_loss as loss
    from hf_varlen.integrations import kernelize

    assert hf_varlen.kernelize is kernelize.kernelize
    assert hf_varlen.KernelizeReport is kernelize.KernelizeReport
    for name in (
        "install_fused_cross_entropy",
        "uninstall_fused_cross_entropy",
        "is_fused_cross_entropy_installed",
    ):
        assert getattr(hf_varlen, name) is getattr(loss, name)
        assert name in hf_varlen.__all__


def test_import_without_triton():
    result = subprocess.run(
        [sys.executable, "-c", _NO_TRITON], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]
