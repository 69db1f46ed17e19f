"""Status codes (SEMANTICS.md §1, API.md) and the LLMError family (API.md "Status and errors").

Every code and class name is written out here from the spec; nothing is derived from kvdd.
"""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest

import kvdd
from kvdd import LLMError, Status

# name -> value, typed from SEMANTICS.md §1 and API.md (0x5010B000 + n).
STATUS_VALUES: dict[str, int] = {
    "LLM_SUCCESS": 0x00000000,
    "LLM_FAILED": 0xFFFFFFFF,
    "LLM_WAIT_PROC_TIMEOUT": 0x5010B001,
    "LLM_KV_CACHE_NOT_EXIST": 0x5010B002,
    "LLM_REPEAT_REQUEST": 0x5010B003,
    "LLM_REQUEST_ALREADY_COMPLETED": 0x5010B004,
    "LLM_PARAM_INVALID": 0x5010B005,
    "LLM_ENGINE_FINALIZED": 0x5010B006,
    "LLM_NOT_YET_LINK": 0x5010B007,
    "LLM_ALREADY_LINK": 0x5010B008,
    "LLM_LINK_FAILED": 0x5010B009,
    "LLM_UNLINK_FAILED": 0x5010B00A,
    "LLM_NOTIFY_PROMPT_UNLINK_FAILED": 0x5010B00B,
    "LLM_CLUSTER_NUM_EXCEED_LIMIT": 0x5010B00C,
    "LLM_PROCESSING_LINK": 0x5010B00D,
    "LLM_DEVICE_OUT_OF_MEMORY": 0x5010B00E,
    "LLM_PREFIX_ALREADY_EXIST": 0x5010B00F,
    "LLM_PREFIX_NOT_EXIST": 0x5010B010,
    "LLM_SEQ_LEN_OVER_LIMIT": 0x5010B011,
    "LLM_NO_FREE_BLOCK": 0x5010B012,
    "LLM_BLOCKS_OUT_OF_MEMORY": 0x5010B013,
    "LLM_CACHE_INCOMPATIBLE": 0x5010B014,
    "LLM_CACHE_KEY_ALREADY_EXIST": 0x5010B015,
    "LLM_COPY_CACHE_FAILED": 0x5010B016,
    "LLM_CACHE_ID_ALREADY_EXIST": 0x5010B017,
    "LLM_EXIST_LINK": 0x5010B018,
    "LLM_FEATURE_NOT_ENABLED": 0x5010B019,
    "LLM_TIMEOUT": 0x5010B01A,
    "LLM_LINK_BUSY": 0x5010B01B,
    "LLM_OUT_OF_MEMORY": 0x5010B01C,
}

# Decimal column of SEMANTICS.md §1, as a cross-check of the hex literals above.
STATUS_DECIMAL: dict[str, int] = {
    "LLM_SUCCESS": 0,
    "LLM_FAILED": 4294967295,
    "LLM_WAIT_PROC_TIMEOUT": 1343270913,
    "LLM_KV_CACHE_NOT_EXIST": 1343270914,
    "LLM_PARAM_INVALID": 1343270917,
    "LLM_NOT_YET_LINK": 1343270919,
    "LLM_ALREADY_LINK": 1343270920,
    "LLM_LINK_FAILED": 1343270921,
    "LLM_UNLINK_FAILED": 1343270922,
    "LLM_NOTIFY_PROMPT_UNLINK_FAILED": 1343270923,
    "LLM_CLUSTER_NUM_EXCEED_LIMIT": 1343270924,
    "LLM_PROCESSING_LINK": 1343270925,
    "LLM_DEVICE_OUT_OF_MEMORY": 1343270926,
    "LLM_EXIST_LINK": 1343270936,
    "LLM_FEATURE_NOT_ENABLED": 1343270937,
    "LLM_TIMEOUT": 1343270938,
    "LLM_LINK_BUSY": 1343270939,
    "LLM_OUT_OF_MEMORY": 1343270940,
}

# status name -> (exact class name, family base name, builtin mix-in or None), from API.md's table.
ERROR_CLASSES: dict[str, tuple[str, str, type[BaseException] | None]] = {
    "LLM_PARAM_INVALID": ("LLMParamInvalidError", "LLMParamInvalidError", ValueError),
    "LLM_KV_CACHE_NOT_EXIST": ("LLMKvCacheNotExistError", "LLMCacheError", LookupError),
    "LLM_CACHE_KEY_ALREADY_EXIST": ("LLMCacheKeyAlreadyExistError", "LLMCacheError", LookupError),
    "LLM_CACHE_ID_ALREADY_EXIST": ("LLMCacheIdAlreadyExistError", "LLMCacheError", LookupError),
    "LLM_CACHE_INCOMPATIBLE": ("LLMCacheIncompatibleError", "LLMCacheError", LookupError),
    "LLM_COPY_CACHE_FAILED": ("LLMCopyCacheFailedError", "LLMCacheError", LookupError),
    "LLM_PREFIX_ALREADY_EXIST": ("LLMPrefixAlreadyExistError", "LLMCacheError", LookupError),
    "LLM_PREFIX_NOT_EXIST": ("LLMPrefixNotExistError", "LLMCacheError", LookupError),
    "LLM_REPEAT_REQUEST": ("LLMRepeatRequestError", "LLMCacheError", LookupError),
    "LLM_REQUEST_ALREADY_COMPLETED": ("LLMRequestAlreadyCompletedError", "LLMCacheError", LookupError),
    "LLM_SEQ_LEN_OVER_LIMIT": ("LLMSeqLenOverLimitError", "LLMCacheError", LookupError),
    "LLM_NOT_YET_LINK": ("LLMNotYetLinkError", "LLMLinkError", None),
    "LLM_ALREADY_LINK": ("LLMAlreadyLinkError", "LLMLinkError", None),
    "LLM_LINK_FAILED": ("LLMLinkFailedError", "LLMLinkError", None),
    "LLM_UNLINK_FAILED": ("LLMUnlinkFailedError", "LLMLinkError", None),
    "LLM_NOTIFY_PROMPT_UNLINK_FAILED": ("LLMNotifyPromptUnlinkFailedError", "LLMLinkError", None),
    "LLM_CLUSTER_NUM_EXCEED_LIMIT": ("LLMClusterNumExceedLimitError", "LLMLinkError", None),
    "LLM_PROCESSING_LINK": ("LLMProcessingLinkError", "LLMLinkError", None),
    "LLM_EXIST_LINK": ("LLMExistLinkError", "LLMLinkError", None),
    "LLM_LINK_BUSY": ("LLMLinkBusyError", "LLMLinkError", None),
    "LLM_TIMEOUT": ("LLMTimeoutError", "LLMTimeoutError", TimeoutError),
    "LLM_WAIT_PROC_TIMEOUT": ("LLMWaitProcTimeoutError", "LLMTimeoutError", TimeoutError),
    "LLM_DEVICE_OUT_OF_MEMORY": ("LLMDeviceOutOfMemoryError", "LLMMemoryError", MemoryError),
    "LLM_OUT_OF_MEMORY": ("LLMOutOfMemoryError", "LLMMemoryError", MemoryError),
    "LLM_NO_FREE_BLOCK": ("LLMNoFreeBlockError", "LLMMemoryError", MemoryError),
    "LLM_BLOCKS_OUT_OF_MEMORY": ("LLMBlocksOutOfMemoryError", "LLMMemoryError", MemoryError),
    "LLM_FEATURE_NOT_ENABLED": ("LLMFeatureNotEnabledError", "LLMFeatureNotEnabledError", NotImplementedError),
    "LLM_FAILED": ("LLMError", "LLMError", None),
    "LLM_ENGINE_FINALIZED": ("LLMError", "LLMError", None),
}
BUILTINS: tuple[type[BaseException], ...] = (
    ValueError, LookupError, TimeoutError, MemoryError, NotImplementedError
)
FAMILY_BASES = ("LLMParamInvalidError", "LLMCacheError", "LLMLinkError", "LLMTimeoutError",
                "LLMMemoryError", "LLMFeatureNotEnabledError")

# Codes real hardware can return that are not in the table (SEMANTICS.md §1, §8: raw ACL codes).
UNKNOWN_CODES = [507053, 507046, 0x5010B01D, 0x5010B000, 1, 0x7FFFFFFF, 0xFFFFFFFE]


def test_status_table_is_exact() -> None:
    assert {m.name: int(m) for m in Status} == STATUS_VALUES
    for name, dec in STATUS_DECIMAL.items():
        assert STATUS_VALUES[name] == dec


@pytest.mark.parametrize("name", list(STATUS_VALUES))
def test_status_value(name: str) -> None:
    assert int(Status[name]) == STATUS_VALUES[name]
    assert Status(STATUS_VALUES[name]).name == name


def test_status_is_an_int_enum() -> None:
    param_invalid: int = Status.LLM_PARAM_INVALID
    assert param_invalid == 0x5010B005
    assert isinstance(Status.LLM_FAILED, int)


def test_every_error_status_has_an_entry_in_the_class_table() -> None:
    # the class table above covers every status except success
    assert set(ERROR_CLASSES) == set(STATUS_VALUES) - {"LLM_SUCCESS"}


@pytest.mark.parametrize("name", list(ERROR_CLASSES))
def test_from_status_gives_exact_class_family_and_builtin(name: str) -> None:
    class_name, family_name, builtin = ERROR_CLASSES[name]
    code = STATUS_VALUES[name]
    for status in (code, Status[name]):
        err = LLMError.from_status(status, "PullKvCache")
        assert type(err).__name__ == class_name
        assert type(err) is getattr(kvdd, class_name)
        assert isinstance(err, getattr(kvdd, family_name))
        assert isinstance(err, LLMError) and isinstance(err, Exception)
        for other in BUILTINS:
            expected = builtin is not None and issubclass(builtin, other)
            assert isinstance(err, other) == expected, (class_name, other.__name__)
        for fam in FAMILY_BASES:
            if fam != family_name:
                assert not isinstance(err, getattr(kvdd, fam))
        assert err.status == code
        assert type(err.status) is Status and err.status is Status[name]
        assert err.rets is None


def test_class_names_follow_the_rule() -> None:
    # class name = "LLM" + CamelCase(status name without LLM_) + "Error", except the plain ones
    for name, (class_name, _, _) in ERROR_CLASSES.items():
        if class_name == "LLMError":
            continue
        camel = "".join(part[0] + part[1:].lower() for part in name.removeprefix("LLM_").split("_"))
        assert class_name == f"LLM{camel}Error"


def test_family_bases() -> None:
    assert issubclass(kvdd.LLMParamInvalidError, ValueError)
    assert issubclass(kvdd.LLMCacheError, LookupError)
    assert issubclass(kvdd.LLMTimeoutError, TimeoutError)
    assert issubclass(kvdd.LLMMemoryError, MemoryError)
    assert issubclass(kvdd.LLMFeatureNotEnabledError, NotImplementedError)
    assert not issubclass(kvdd.LLMLinkError, BUILTINS)
    assert not issubclass(LLMError, BUILTINS)
    for fam in FAMILY_BASES:
        assert getattr(kvdd, fam).__bases__[0] is LLMError
    assert kvdd.LLMWaitProcTimeoutError.__bases__ == (kvdd.LLMTimeoutError,)
    # one class per name: no class appears twice in an MRO
    for name in ERROR_CLASSES:
        mro = type(LLMError.from_status(STATUS_VALUES[name])).__mro__
        assert len({c.__name__ for c in mro}) == len(mro)


@pytest.mark.parametrize("code", UNKNOWN_CODES)
def test_unknown_codes_are_plain_llm_error_with_raw_status(code: int) -> None:
    err = LLMError.from_status(code, "RegisterKvCache")
    assert type(err) is LLMError
    assert err.status == code
    # API.md: always a Status; unknown codes are pseudo-members whose value is the raw number
    # and whose name says they are unknown.
    assert type(err.status) is Status
    assert int(err.status) == code and type(int(err.status)) is int
    assert err.status.name == f"UNKNOWN_0x{code:08X}"
    assert err.status not in list(Status) and err.status.name not in Status.__members__
    assert Status(code) is err.status  # one pseudo-member per number
    assert f"{code:X}" in str(err).upper()
    assert "unknown status" in str(err)


def test_rets() -> None:
    link_failed = 0x5010B009
    err = LLMError.from_status(link_failed, "LinkLlmClusters", rets=[0, link_failed])
    assert type(err) is kvdd.LLMLinkFailedError
    assert err.rets == [0, link_failed]
    assert isinstance(err.rets, list)
    err = LLMError.from_status(0x5010B005, "LinkLlmClusters", rets=[])
    assert err.rets == []
    assert LLMError.from_status(0x5010B005, "PullKvCache").rets is None
    # unknown per-cluster codes are kept as raw numbers
    err = LLMError.from_status(0xFFFFFFFF, "UnlinkLlmClusters", rets=[507053, 0xFFFFFFFF])
    assert err.rets == [507053, 0xFFFFFFFF]


@pytest.mark.parametrize("name", list(ERROR_CLASSES))
def test_message_names_status_hex_and_what_failed(name: str) -> None:
    code = STATUS_VALUES[name]
    err = LLMError.from_status(code, "PushKvBlocks: remote cache 7 not found")
    text = str(err)
    assert name in text
    assert f"0X{code:08X}" in text.upper()
    assert "PushKvBlocks: remote cache 7 not found" in text


def _roundtrip(err: LLMError) -> Any:
    return pickle.loads(pickle.dumps(err))


@pytest.mark.parametrize("name", list(ERROR_CLASSES))
def test_pickle_round_trip(name: str) -> None:
    code = STATUS_VALUES[name]
    for rets in (None, [], [0, code]):
        err = LLMError.from_status(code, "LinkLlmClusters", rets=rets)
        back = _roundtrip(err)
        assert type(back) is type(err)
        assert back.status == code and type(back.status) is Status
        assert back.rets == rets
        assert str(back) == str(err)
        assert back.args == err.args
        c = copy.deepcopy(err)
        assert type(c) is type(err) and c.status == code and c.rets == rets and str(c) == str(err)
    for proto in range(pickle.HIGHEST_PROTOCOL + 1):
        back = pickle.loads(pickle.dumps(LLMError.from_status(code, "x"), protocol=proto))
        assert type(back) is type(LLMError.from_status(code, "x"))


def test_pickle_unknown_code() -> None:
    err = LLMError.from_status(507053, "PullKvCache", rets=None)
    back = _roundtrip(err)
    assert type(back) is LLMError and back.status == 507053 and type(back.status) is Status
    assert back.status.name == "UNKNOWN_0x0007BCAD" and int(back.status) == 507053
    assert str(back) == str(err)
    assert pickle.loads(pickle.dumps(err.status)) is Status(507053)
    err = LLMError.from_status(0xFFFFFFFF, "UnlinkLlmClusters", rets=[507053, 0])
    back = _roundtrip(err)
    assert back.rets == [507053, 0] and [type(r) for r in back.rets] == [Status, Status]


def test_direct_construction() -> None:
    err = kvdd.LLMNotYetLinkError(Status.LLM_NOT_YET_LINK, "PullKvCache")
    assert err.status == 0x5010B007 and err.rets is None
    assert "LLM_NOT_YET_LINK" in str(err)
    with pytest.raises(kvdd.LLMLinkError):
        raise err


def test_errors_are_exported() -> None:
    names = {c for c, _, _ in ERROR_CLASSES.values()} | set(FAMILY_BASES) | {
        "LLMError", "Status", "BackendUnavailableError"
    }
    for name in names:
        assert name in kvdd.__all__, name
        assert getattr(kvdd, name) is getattr(kvdd.status, name)
    assert len(kvdd.__all__) == len(set(kvdd.__all__))


def test_backend_unavailable_error_is_import_error() -> None:
    assert issubclass(kvdd.BackendUnavailableError, ImportError)
    assert not issubclass(kvdd.BackendUnavailableError, LLMError)
