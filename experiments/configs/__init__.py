"""The experiment configs: each module here has a `get_config()` returning a locked ConfigDict (`load` by name)."""
import importlib
import importlib.util
import pathlib

HERE = pathlib.Path(__file__).parent


def names() -> list[str]:
  """The config names (the modules of this folder with a `get_config`)."""
  return sorted(p.stem for p in HERE.glob("*.py") if not p.stem.startswith("_") and "def get_config" in p.read_text())


def load(name_or_path: str):
  """`get_config()` of experiments/configs/<name>.py, or of a .py file; ValueError for an unknown name."""
  if name_or_path.endswith(".py"):
    path = pathlib.Path(name_or_path)
    if not path.is_file():
      raise FileNotFoundError(f"config file {name_or_path} does not exist")
    spec = importlib.util.spec_from_file_location(f"config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
  elif name_or_path in names():
    module = importlib.import_module(f"{__name__}.{name_or_path}")
  else:
    raise ValueError(f"unknown config {name_or_path!r}: expected one of {names()} or a path to a .py file")
  if not hasattr(module, "get_config"):
    raise ValueError(f"config {name_or_path!r} has no get_config()")
  return module.get_config()
