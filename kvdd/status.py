"""LLM-DataDist status codes and the exception family built on them.

The C++ API returns ``ge::Status`` (``uint32_t``) from every call; the values are listed in
docs/spec/SEMANTICS.md §1 (``LLM_SUCCESS = 0``, ``LLM_FAILED = 0xFFFFFFFF`` and
``0x5010B000 + n``).  Backends return these integers; :func:`raise_for_status` is the one place
where a non-zero status becomes an :class:`LLMError` (docs/spec/API.md "Status and errors").
"""

from __future__ import annotations

import enum
import threading
from typing import Any, ClassVar

__all__ = [
    "Status",
    "status_name",
    "LLMError",
    "LLMParamInvalidError",
    "LLMCacheError",
    "LLMLinkError",
    "LLMTimeoutError",
    "LLMMemoryError",
    "LLMFeatureNotEnabledError",
    "BackendUnavailableError",
    "raise_for_status",
    "LLMKvCacheNotExistError",
    "LLMCacheKeyAlreadyExistError",
    "LLMCacheIdAlreadyExistError",
    "LLMCacheIncompatibleError",
    "LLMCopyCacheFailedError",
    "LLMPrefixAlreadyExistError",
    "LLMPrefixNotExistError",
    "LLMRepeatRequestError",
    "LLMRequestAlreadyCompletedError",
    "LLMSeqLenOverLimitError",
    "LLMNotYetLinkError",
    "LLMAlreadyLinkError",
    "LLMLinkFailedError",
    "LLMUnlinkFailedError",
    "LLMNotifyPromptUnlinkFailedError",
    "LLMClusterNumExceedLimitError",
    "LLMProcessingLinkError",
    "LLMExistLinkError",
    "LLMLinkBusyError",
    "LLMWaitProcTimeoutError",
    "LLMDeviceOutOfMemoryError",
    "LLMOutOfMemoryError",
    "LLMNoFreeBlockError",
    "LLMBlocksOutOfMemoryError",
]

_BASE = 0x5010B000


class Status(enum.IntEnum):
    """Every status code of the LLM-DataDist error table (docs/spec/SEMANTICS.md §1).

    ``Status.LLM_PARAM_INVALID == 0x5010B005``.  Hardware can also return raw numbers outside this
    table (ACL runtime codes, docs/spec/SEMANTICS.md §8): ``Status(code)`` then gives a *pseudo-member*
    whose value is the raw number and whose name says it is unknown (``Status(507053).name ==
    'UNKNOWN_0x0007BCAD'``), so ``.name`` and ``int()`` work for every status.  Pseudo-members are
    not listed by iteration or ``Status.__members__``, compare equal to their number and pickle
    by value.

    Raises
    ------
    ValueError
        ``Status(x)`` for an ``x`` that is not an integer (``bool`` included).
    """

    LLM_SUCCESS = 0
    LLM_WAIT_PROC_TIMEOUT = _BASE + 1
    LLM_KV_CACHE_NOT_EXIST = _BASE + 2
    LLM_REPEAT_REQUEST = _BASE + 3
    LLM_REQUEST_ALREADY_COMPLETED = _BASE + 4
    LLM_PARAM_INVALID = _BASE + 5
    LLM_ENGINE_FINALIZED = _BASE + 6
    LLM_NOT_YET_LINK = _BASE + 7
    LLM_ALREADY_LINK = _BASE + 8
    LLM_LINK_FAILED = _BASE + 9
    LLM_UNLINK_FAILED = _BASE + 10
    LLM_NOTIFY_PROMPT_UNLINK_FAILED = _BASE + 11
    LLM_CLUSTER_NUM_EXCEED_LIMIT = _BASE + 12
    LLM_PROCESSING_LINK = _BASE + 13
    LLM_DEVICE_OUT_OF_MEMORY = _BASE + 14
    LLM_PREFIX_ALREADY_EXIST = _BASE + 15
    LLM_PREFIX_NOT_EXIST = _BASE + 16
    LLM_SEQ_LEN_OVER_LIMIT = _BASE + 17
    LLM_NO_FREE_BLOCK = _BASE + 18
    LLM_BLOCKS_OUT_OF_MEMORY = _BASE + 19
    LLM_CACHE_INCOMPATIBLE = _BASE + 20
    LLM_CACHE_KEY_ALREADY_EXIST = _BASE + 21
    LLM_COPY_CACHE_FAILED = _BASE + 22
    LLM_CACHE_ID_ALREADY_EXIST = _BASE + 23
    LLM_EXIST_LINK = _BASE + 24
    LLM_FEATURE_NOT_ENABLED = _BASE + 25
    LLM_TIMEOUT = _BASE + 26
    LLM_LINK_BUSY = _BASE + 27
    LLM_OUT_OF_MEMORY = _BASE + 28
    LLM_FAILED = 0xFFFFFFFF

    @classmethod
    def _missing_(cls, value: object) -> Status | None:
        # A code outside the table: one cached pseudo-member per number (as enum.Flag does for
        # combinations), so identity, hashing and pickling behave like a real member's.
        if isinstance(value, bool) or not isinstance(value, int):
            return None
        number = int(value)
        with _PSEUDO_LOCK:
            member = cls._value2member_map_.get(number)
            if member is None:
                member = int.__new__(cls, number)
                member._name_ = f"{UNKNOWN_PREFIX}0x{number & 0xFFFFFFFF:08X}"
                member._value_ = number
                cls._value2member_map_[number] = member
        assert isinstance(member, cls)
        return member

    @property
    def is_known(self) -> bool:
        """False for a pseudo-member (a code outside the table of docs/spec/SEMANTICS.md §1)."""
        return self._name_ in type(self).__members__


#: Name prefix of the pseudo-members :class:`Status` makes for codes outside its table.
UNKNOWN_PREFIX = "UNKNOWN_"
_PSEUDO_LOCK = threading.Lock()

# Short names for the statuses the simulator returns most; import these instead of redefining them.
S_OK = Status.LLM_SUCCESS
FAILED = Status.LLM_FAILED
PARAM_INVALID = Status.LLM_PARAM_INVALID
NOT_EXIST = Status.LLM_KV_CACHE_NOT_EXIST
NOT_YET_LINK = Status.LLM_NOT_YET_LINK
TIMEOUT = Status.LLM_TIMEOUT


def as_status(value: int) -> Status:
    """``Status(value)``: the member for a known code, else the pseudo-member of the raw number.

    Parameters
    ----------
    value : int
        A ``ge::Status`` as a backend returns it.

    Returns
    -------
    Status
        Always a :class:`Status`; ``int(result) == value``.
    """
    return Status(value)


def status_name(value: int) -> str:
    """The name and hex code of a status, as error messages print it.

    Parameters
    ----------
    value : int
        Any status code (known or not).

    Returns
    -------
    str
        ``'LLM_PARAM_INVALID (0x5010B005)'``; codes outside the table give
        ``'unknown status (0x0007BCAD)'``.
    """
    status = Status(value)
    name = status.name if status.is_known else "unknown status"
    return f"{name} (0x{int(value) & 0xFFFFFFFF:08X})"


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


class LLMError(Exception):
    """A non-success status returned by an LLM-DataDist call (docs/spec/API.md "Status and errors").

    Parameters
    ----------
    status : int
        The ``ge::Status`` the C++ call returned (a :class:`Status` or a raw number).
    message : str, optional
        What failed (the C++ call) and the backend's explanation.
    rets : list[int] or None, optional
        Per-cluster statuses of LinkLlmClusters / UnlinkLlmClusters.

    Attributes
    ----------
    status : Status
        The status; for a code outside the table a :class:`Status` pseudo-member whose value is
        the raw number (``int(e.status)``) and whose name starts with ``UNKNOWN_``.
    rets : list[int] | None
        Per-cluster statuses for link/unlink, each a :class:`Status` (``[]`` when the call
        failed before the per-cluster phase), ``None`` for every other call.
    detail : str
        ``message`` as given.

    Notes
    -----
    Use :meth:`from_status` to get the class matching a status; tests should assert the exact
    class and ``.status``.  Instances pickle with all attributes.
    """

    #: status -> class registry; filled as the classes below are defined.
    _registry: ClassVar[dict[int, type[LLMError]]] = {}

    def __init__(self, status: int, message: str = "", rets: list[int] | None = None) -> None:
        self.status: Status = as_status(status)
        self.rets: list[int] | None = None if rets is None else [as_status(r) for r in rets]
        self.detail = message
        text = f"{status_name(self.status)}: {message}" if message else status_name(self.status)
        super().__init__(text)

    def __reduce__(self) -> tuple[Any, ...]:
        rets = None if self.rets is None else [int(r) for r in self.rets]
        return (_rebuild_error, (type(self), int(self.status), self.detail, rets))

    @classmethod
    def from_status(cls, status: int, message: str = "", rets: list[int] | None = None) -> LLMError:
        """The exception for ``status``: an instance of the class registered for it.

        Parameters
        ----------
        status : int
            A ``ge::Status`` (known or not).
        message : str, optional
            What failed.
        rets : list[int] or None, optional
            Per-cluster statuses (link/unlink only).

        Returns
        -------
        LLMError
            The subclass of docs/spec/API.md's table; plain ``LLMError`` for unknown codes,
            ``LLM_FAILED`` and ``LLM_ENGINE_FINALIZED``.
        """
        klass = LLMError._registry.get(int(status), LLMError)
        return klass(status, message, rets)


def _rebuild_error(klass: type[LLMError], status: int, message: str, rets: list[int] | None) -> LLMError:
    return klass(status, message, rets)


class LLMParamInvalidError(LLMError, ValueError):
    """LLM_PARAM_INVALID: the C++ call rejected an argument or option."""


class LLMCacheError(LLMError, LookupError):
    """Family base for cache-lookup statuses (KV_CACHE_NOT_EXIST, ...)."""


class LLMLinkError(LLMError):
    """Family base for link statuses (NOT_YET_LINK, ALREADY_LINK, LINK_FAILED, ...)."""


class LLMTimeoutError(LLMError, TimeoutError):
    """LLM_TIMEOUT, and family base of LLM_WAIT_PROC_TIMEOUT (docs/spec/API.md: class name = status name)."""


class LLMMemoryError(LLMError, MemoryError):
    """Family base for out-of-memory statuses."""


class LLMFeatureNotEnabledError(LLMError, NotImplementedError):
    """LLM_FEATURE_NOT_ENABLED: the call is not supported by this library build (docs/spec/SEMANTICS.md §3.9)."""


class LLMKvCacheNotExistError(LLMCacheError):
    """LLM_KV_CACHE_NOT_EXIST."""

class LLMCacheKeyAlreadyExistError(LLMCacheError):
    """LLM_CACHE_KEY_ALREADY_EXIST."""

class LLMCacheIdAlreadyExistError(LLMCacheError):
    """LLM_CACHE_ID_ALREADY_EXIST."""

class LLMCacheIncompatibleError(LLMCacheError):
    """LLM_CACHE_INCOMPATIBLE."""

class LLMCopyCacheFailedError(LLMCacheError):
    """LLM_COPY_CACHE_FAILED."""

class LLMPrefixAlreadyExistError(LLMCacheError):
    """LLM_PREFIX_ALREADY_EXIST."""

class LLMPrefixNotExistError(LLMCacheError):
    """LLM_PREFIX_NOT_EXIST."""

class LLMRepeatRequestError(LLMCacheError):
    """LLM_REPEAT_REQUEST."""

class LLMRequestAlreadyCompletedError(LLMCacheError):
    """LLM_REQUEST_ALREADY_COMPLETED."""

class LLMSeqLenOverLimitError(LLMCacheError):
    """LLM_SEQ_LEN_OVER_LIMIT."""

class LLMNotYetLinkError(LLMLinkError):
    """LLM_NOT_YET_LINK."""

class LLMAlreadyLinkError(LLMLinkError):
    """LLM_ALREADY_LINK."""

class LLMLinkFailedError(LLMLinkError):
    """LLM_LINK_FAILED."""

class LLMUnlinkFailedError(LLMLinkError):
    """LLM_UNLINK_FAILED."""

class LLMNotifyPromptUnlinkFailedError(LLMLinkError):
    """LLM_NOTIFY_PROMPT_UNLINK_FAILED."""

class LLMClusterNumExceedLimitError(LLMLinkError):
    """LLM_CLUSTER_NUM_EXCEED_LIMIT."""

class LLMProcessingLinkError(LLMLinkError):
    """LLM_PROCESSING_LINK."""

class LLMExistLinkError(LLMLinkError):
    """LLM_EXIST_LINK."""

class LLMLinkBusyError(LLMLinkError):
    """LLM_LINK_BUSY."""

class LLMWaitProcTimeoutError(LLMTimeoutError):
    """LLM_WAIT_PROC_TIMEOUT."""

class LLMDeviceOutOfMemoryError(LLMMemoryError):
    """LLM_DEVICE_OUT_OF_MEMORY."""

class LLMOutOfMemoryError(LLMMemoryError):
    """LLM_OUT_OF_MEMORY."""

class LLMNoFreeBlockError(LLMMemoryError):
    """LLM_NO_FREE_BLOCK."""

class LLMBlocksOutOfMemoryError(LLMMemoryError):
    """LLM_BLOCKS_OUT_OF_MEMORY."""


_CLASS_BY_STATUS: tuple[tuple[Status, type[LLMError]], ...] = (
    (Status.LLM_PARAM_INVALID, LLMParamInvalidError),
    (Status.LLM_FEATURE_NOT_ENABLED, LLMFeatureNotEnabledError),
    (Status.LLM_KV_CACHE_NOT_EXIST, LLMKvCacheNotExistError),
    (Status.LLM_CACHE_KEY_ALREADY_EXIST, LLMCacheKeyAlreadyExistError),
    (Status.LLM_CACHE_ID_ALREADY_EXIST, LLMCacheIdAlreadyExistError),
    (Status.LLM_CACHE_INCOMPATIBLE, LLMCacheIncompatibleError),
    (Status.LLM_COPY_CACHE_FAILED, LLMCopyCacheFailedError),
    (Status.LLM_PREFIX_ALREADY_EXIST, LLMPrefixAlreadyExistError),
    (Status.LLM_PREFIX_NOT_EXIST, LLMPrefixNotExistError),
    (Status.LLM_REPEAT_REQUEST, LLMRepeatRequestError),
    (Status.LLM_REQUEST_ALREADY_COMPLETED, LLMRequestAlreadyCompletedError),
    (Status.LLM_SEQ_LEN_OVER_LIMIT, LLMSeqLenOverLimitError),
    (Status.LLM_NOT_YET_LINK, LLMNotYetLinkError),
    (Status.LLM_ALREADY_LINK, LLMAlreadyLinkError),
    (Status.LLM_LINK_FAILED, LLMLinkFailedError),
    (Status.LLM_UNLINK_FAILED, LLMUnlinkFailedError),
    (Status.LLM_NOTIFY_PROMPT_UNLINK_FAILED, LLMNotifyPromptUnlinkFailedError),
    (Status.LLM_CLUSTER_NUM_EXCEED_LIMIT, LLMClusterNumExceedLimitError),
    (Status.LLM_PROCESSING_LINK, LLMProcessingLinkError),
    (Status.LLM_EXIST_LINK, LLMExistLinkError),
    (Status.LLM_LINK_BUSY, LLMLinkBusyError),
    (Status.LLM_TIMEOUT, LLMTimeoutError),
    (Status.LLM_WAIT_PROC_TIMEOUT, LLMWaitProcTimeoutError),
    (Status.LLM_DEVICE_OUT_OF_MEMORY, LLMDeviceOutOfMemoryError),
    (Status.LLM_OUT_OF_MEMORY, LLMOutOfMemoryError),
    (Status.LLM_NO_FREE_BLOCK, LLMNoFreeBlockError),
    (Status.LLM_BLOCKS_OUT_OF_MEMORY, LLMBlocksOutOfMemoryError),
)


def _register_all() -> None:
    for status, klass in _CLASS_BY_STATUS:
        if int(status) in LLMError._registry:
            raise RuntimeError(f"duplicate exception class for {status.name}")
        LLMError._registry[int(status)] = klass


_register_all()


class BackendUnavailableError(ImportError):
    """The requested backend is not built in this installation or cannot be loaded here."""


def raise_for_status(
    status: int, what: str, rets: list[int] | None = None, detail: str | None = None
) -> None:
    """Raise the :class:`LLMError` subclass for ``status`` unless it is ``LLM_SUCCESS``.

    This is the single place where backend statuses become exceptions (the facade calls it after
    every backend call).

    Parameters
    ----------
    status : int
        The status a backend returned.
    what : str
        The C++ call (``"PullKvCache"``).
    rets : list[int] or None, optional
        Per-cluster statuses (link/unlink only).
    detail : str or None, optional
        The backend's explanation, appended to the message.

    Raises
    ------
    LLMError
        The subclass :meth:`LLMError.from_status` picks, for any non-zero ``status``.
    """
    if status == Status.LLM_SUCCESS:
        return
    message = what if not detail else f"{what}: {detail}"
    raise LLMError.from_status(status, message, rets)
