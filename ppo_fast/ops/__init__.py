"""The public ops, one module per op home: validation and backend dispatch in front of the
reference, Triton and native implementations (``ppo_fast.backends.<backend>.<op>``).  The public
API is every op module's ``__all__``: adding an op's module here adds its functions to ``ppo_fast``."""

from ..backends import op_modules

MODULES = op_modules(__name__, __path__)
__all__ = [name for module in MODULES for name in module.__all__]
globals().update({name: getattr(module, name) for module in MODULES for name in module.__all__})
