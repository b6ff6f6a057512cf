"""Attribute forwarding: a wrapper reads the attributes it lacks from the module it wraps.

[Note: one recursion guard]
``__getattr__`` runs only after ordinary lookup failed, and it also runs on a
half-built wrapper: inside ``__init__`` before the wrapped module is set, or on an
object that ``copy`` or ``pickle`` made with ``cls.__new__`` and has not filled yet
(not even ``nn.Module``'s ``_modules``). Reading the wrapped module as ``self.module``
there would call ``__getattr__`` again, and ``self._modules`` on an object without it
would recurse until RecursionError. :class:`ForwardingMixin` reads the wrapped module
from ``self.__dict__`` only (an instance's ``__dict__`` never goes through
``__getattr__``), so a missing wrapped module ends in an AttributeError at once.

Names of the form ``__name__`` (``__deepcopy__``, ``__getnewargs_ex__``,
``__setstate__``, ...) are never forwarded: ``copy`` and ``pickle`` look them up on the
object they copy, and must find the wrapper's protocol (or none), not the wrapped
module's, which would copy the wrapped module in place of the wrapper.
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import nn

__all__ = ["ForwardingMixin"]


def _is_dunder(name: str) -> bool:
    return len(name) > 4 and name.startswith("__") and name.endswith("__")


class ForwardingMixin(nn.Module):
    """Attributes a wrapper lacks are the wrapped module's (``wrapper.config``).

    List it first among the wrapper's bases and name the child that holds the wrapped
    module in ``_forward_to`` (a key of the wrapper's ``_modules``; default
    ``"module"``)::

        class MyWrapper(ForwardingMixin, nn.Module):
            _forward_to = "module"

    An attribute that ordinary lookup and ``nn.Module``'s (parameters, buffers,
    children) do not find on the wrapper is read from the wrapped module; setting
    attributes is not forwarded here. Names of the form ``__name__`` are never
    forwarded (see [Note: one recursion guard]).

    Raises:
        AttributeError: from attribute access, when neither the wrapper nor the
            wrapped module has the attribute, or the wrapped module is not set yet;
            the message names the wrapper's class, the attribute and the wrapped
            module's class.
    """

    _forward_to: ClassVar[str] = "module"

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)  # parameters, buffers, children
        except AttributeError:
            pass
        wrapped = self.__dict__.get("_modules", {}).get(self._forward_to)
        if wrapped is None:
            raise AttributeError(
                f"{type(self).__name__!r} object has no attribute {name!r} (and its wrapped "
                f"module, {self._forward_to!r}, is not set yet: the wrapper is still in "
                "__init__, or a half-built copy)"
            )
        if _is_dunder(name):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        try:
            return getattr(wrapped, name)
        except AttributeError as error:
            raise AttributeError(
                f"{type(self).__name__!r} object has no attribute {name!r}, nor has the "
                f"{type(wrapped).__name__} it wraps (at {self._forward_to!r})"
            ) from error
