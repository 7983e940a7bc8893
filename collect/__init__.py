"""steplens in-job collector: attach to a DeepSpeed engine (or a torch model and optimizer) and write the
run folder `analyze` reads. torch and deepspeed are imported only when attaching.

    collector = steplens.collect.attach(engine)   # settings: the ds_config block "steplens"
    collector.log("train/loss", loss.item())
    collector.close()                              # also runs at exit
"""

from importlib.metadata import PackageNotFoundError, version

from .collector import Collector, Settings, attach

try:
    __version__ = version("steplens")
except PackageNotFoundError:  # running from a source tree without installing
    __version__ = None

__all__ = ["Collector", "Settings", "attach"]
