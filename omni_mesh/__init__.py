"""omni-mesh: multi-stage omni-modality inference pipelines as a mesh of asyncio services."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("omni-mesh")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+source"
