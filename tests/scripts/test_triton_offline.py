"""scripts/triton_offline.py's dump half (the compile half needs the GPU image's triton, not a test dependency)."""
import json
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_dump_writes_each_forward_launch_as_text_ir_with_its_launch_parameters(tmp_path):
  done = subprocess.run([sys.executable, "scripts/triton_offline.py", "dump", "--shape=1x128x2x64",
                         f"--out={tmp_path}"], cwd=REPO, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  launches = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("*.json")}
  assert launches == {"kda_prepare": dict(num_stages=1, num_warps=4),
                      "kda_intra_fwd_key_tiles": dict(num_stages=3, num_warps=2),
                      "kda_state_fwd": dict(num_stages=2, num_warps=4)}
  for name in launches:
    text = (tmp_path / f"{name}.ttir").read_text()
    assert f"tt.func public @{name}" in text and '"gpu.barrier"' not in text, name
  assert "tt.dot" in (tmp_path / "kda_intra_fwd_key_tiles.ttir").read_text()
