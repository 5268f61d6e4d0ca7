"""The honest flush the cheats wrap: solutions/torch_v1/flush.py, loaded by path."""
import importlib.util
from pathlib import Path

_path = Path(__file__).resolve().parents[2] / "solutions" / "torch_v1" / "flush.py"
_spec = importlib.util.spec_from_file_location("honest_flush", _path)
honest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(honest)
flush = honest.run
