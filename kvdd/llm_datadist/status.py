"""Status codes and the exception of CANN's ``llm_datadist`` package (PYPKG.md §1.2, §5.5).

``LLMStatusCode`` values are the engine's ``ge`` status codes; :func:`code_2_status` maps an engine
status to a member and turns anything it does not know into ``LLM_FAILED``;
:func:`handle_llm_status` is the one place an engine status becomes an :class:`LLMException`.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any, NoReturn

from .utils.log import logger

__all__ = [
    "LLMStatusCode",
    "LLMException",
    "Status",
    "code_2_status",
    "handle_llm_status",
    "raise_if_false",
    "raise_if_true",
]


class LLMStatusCode(IntEnum):
    """Statuses of LLM-DataDist (PYPKG.md §1.2): ``0x5010B000 + n`` codes, two ACL runtime codes,
    ``LLM_FAILED`` (0xFFFFFFFF) and ``LLM_UNKNOWN_ERROR`` (-1, never produced by the package).
    ``str()`` is ``"LLMStatusCode.NAME"``."""

    LLM_SUCCESS = 0
    LLM_FAILED = 0xFFFFFFFF
    LLM_WAIT_PROCESS_TIMEOUT = 0x5010B001
    LLM_KV_CACHE_NOT_EXIST = 0x5010B002
    LLM_REPEAT_REQUEST = 0x5010B003
    LLM_REQUEST_ALREADY_COMPLETED = 0x5010B004
    LLM_PARAM_INVALID = 0x5010B005
    LLM_ENGINE_FINALIZED = 0x5010B006
    LLM_NOT_YET_LINK = 0x5010B007
    LLM_ALREADY_LINK = 0x5010B008
    LLM_LINK_FAILED = 0x5010B009
    LLM_UNLINK_FAILED = 0x5010B00A
    LLM_NOTIFY_PROMPT_UNLINK_FAILED = 0x5010B00B
    LLM_CLUSTER_NUM_EXCEED_LIMIT = 0x5010B00C
    LLM_PROCESSING_LINK = 0x5010B00D
    LLM_DEVICE_OUT_OF_MEMORY = 0x5010B00E
    LLM_PREFIX_ALREADY_EXIST = 0x5010B00F
    LLM_PREFIX_NOT_EXIST = 0x5010B010
    LLM_SEQ_LENOVERLIMIT = 0x5010B011
    LLM_NO_FREE_BLOCK = 0x5010B012
    LLM_BLOCKS_OUT_OF_MEMORY = 0x5010B013
    LLM_EXIST_LINK = 0x5010B018
    LLM_FEATURE_NOT_ENABLED = 0x5010B019
    LLM_TIMEOUT = 0x5010B01A
    LLM_LINK_BUSY = 0x5010B01B
    LLM_OUT_OF_MEMORY = 0x5010B01C
    LLM_DEVICE_MEM_ERROR = 507053
    LLM_SUSPECT_REMOTE_ERROR = 507057
    LLM_UNKNOWN_ERROR = -1

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"

    def __format__(self, spec: str) -> str:
        # f"{code}" == str(code) on every Python version; f"{code:#x}" formats the number
        return str(self) if not spec else format(int(self), spec)


_BY_VALUE: dict[int, LLMStatusCode] = {
    int(code): code for code in LLMStatusCode if code is not LLMStatusCode.LLM_UNKNOWN_ERROR
}


def code_2_status(code: int) -> LLMStatusCode:
    """The member for an engine status; any value outside the table (raw ACL codes, -1, ...) is
    ``LLM_FAILED`` (PYPKG.md §1.2)."""
    return _BY_VALUE.get(int(code), LLMStatusCode.LLM_FAILED)


class LLMException(RuntimeError):
    """An LLM-DataDist failure with its status (PYPKG.md §5.5); a ``RuntimeError``.

    Parameters
    ----------
    *args
        The message (as for any exception).
    status_code
        The :class:`LLMStatusCode` (default ``LLM_SUCCESS``, as upstream's constructor).
    """

    def __init__(self, *args: object, status_code: LLMStatusCode = LLMStatusCode.LLM_SUCCESS) -> None:
        super().__init__(*args)
        self._status_code = status_code

    @property
    def status_code(self) -> LLMStatusCode:
        """The status this exception carries."""
        return self._status_code

    def __reduce__(self) -> tuple[Any, ...]:
        # keeps status_code through pickling (multiprocessing, concurrent.futures)
        return (_rebuild_exception, (self.args, self._status_code))


def _rebuild_exception(args: tuple[object, ...], status_code: LLMStatusCode) -> LLMException:
    return LLMException(*args, status_code=status_code)


class Status:
    """A status value with :meth:`is_ok` (PYPKG.md §5.5; exported, unused by the package)."""

    def __init__(self, status: LLMStatusCode) -> None:
        self._status = status

    def is_ok(self) -> bool:
        """True for ``LLM_SUCCESS``."""
        return self._status == LLMStatusCode.LLM_SUCCESS

    @property
    def status_code(self) -> LLMStatusCode:
        """The wrapped status."""
        return self._status

    def __repr__(self) -> str:
        return f"Status({self._status})"


def handle_llm_status(status: int, func_name: str, info: object) -> None:
    """Raise ``LLMException(code_2_status(status))`` unless ``status`` is success; the message is
    ``"<func_name> failed, error code is LLMStatusCode.<NAME>, <info>."`` (PYPKG.md §5.5).

    As upstream, the failure is raised, not logged at ERROR (a caller may catch and retry it);
    it is logged at DEBUG."""
    code = code_2_status(status)
    if code != LLMStatusCode.LLM_SUCCESS:
        message = f"{func_name} failed, error code is {code}, {info}."
        logger.debug(message)
        raise LLMException(message, status_code=code)


def raise_if_false(condition: object, message: str, *args: object,
                   status_code: LLMStatusCode = LLMStatusCode.LLM_PARAM_INVALID, **kwargs: object) -> None:
    """Log the message at ERROR and raise ``LLMException(status_code)`` when ``condition`` is
    false (PYPKG.md §1.1).  As upstream, ``message`` is a ``str.format`` template for ``args`` /
    ``kwargs`` (used as given when there are none)."""
    if not condition:
        _fail(_format(message, args, kwargs), status_code)


def raise_if_true(condition: object, message: str, *args: object,
                  status_code: LLMStatusCode = LLMStatusCode.LLM_PARAM_INVALID, **kwargs: object) -> None:
    """Log the message at ERROR and raise ``LLMException(status_code)`` when ``condition`` is
    true (PYPKG.md §1.1); ``message`` as in :func:`raise_if_false`."""
    if condition:
        _fail(_format(message, args, kwargs), status_code)


def _format(message: str, args: tuple[object, ...], kwargs: dict[str, object]) -> str:
    return message.format(*args, **kwargs) if args or kwargs else message


def _fail(message: str, status_code: LLMStatusCode) -> NoReturn:
    logger.error(message)
    raise LLMException(message, status_code=status_code)
