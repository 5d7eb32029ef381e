"""autopar: semi-automatic parallelism for PaddlePaddle static (PIR) programs."""

from autopar import errors
from autopar.dist_attr import DistAttr
from autopar.errors import AutoparError
from autopar.mesh import ProcessMesh

__all__ = ["AutoparError", "DistAttr", "ProcessMesh", "errors"]
