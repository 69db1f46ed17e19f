# Included by _datadist.pyx (textually, sharing its cimports): the loaded library itself --
# std helpers, the C shim that finds libllm_datadist.so and asks it (or ACL) about itself, and the
# module functions that report on it (header_constants, build_info).

cdef extern from "<shared_mutex>" namespace "std" nogil:
    cdef cppclass shared_mutex:
        shared_mutex() except +
        void lock()
        void unlock()
        void lock_shared()
        void unlock_shared()


cdef extern from "<string>" namespace "std":
    cdef cppclass string_t "std::string":
        const char* c_str()
        size_t size()


cdef extern from *:
    """
    #include <dlfcn.h>
    #include <link.h>
    #include <string>
    #ifndef KVDD_TEST_DOUBLE
    #define KVDD_TEST_DOUBLE 0
    #endif
    /* The loaded libllm_datadist.so (already mapped as a dependency of this module). */
    static void *kvdd_library_handle(void) {
        return dlopen("libllm_datadist.so", RTLD_LAZY | RTLD_NOLOAD);
    }
    static void *kvdd_test_double_symbol(const char *name) {
    #if KVDD_TEST_DOUBLE
        void *sym = NULL;
        void *handle = kvdd_library_handle();
        if (handle != NULL) {
            sym = dlsym(handle, name);
            dlclose(handle);
        }
        if (sym == NULL) {
            sym = dlsym(RTLD_DEFAULT, name);
        }
        return sym;
    #else
        (void)name;
        return NULL;
    #endif
    }
    /* Test double only: the port the simulator bound; -1 not listening, <= -2 unknown. */
    static int kvdd_td_listen_port(void *dd) {
        typedef int (*fn_t)(void *);
        fn_t fn = (fn_t)kvdd_test_double_symbol("kvdd_testdouble_listen_port");
        return fn == NULL ? -3 : fn(dd);
    }
    /* The library's explanation of the calling thread's last failed call, NULL when it has none:
       the simulated root's kvdd_testdouble_last_error, else ACL's aclGetRecentErrMsg (CANN's
       libascendcl.so, where the runtime records its errors) when it is loaded. */
    static const char *kvdd_library_message(void) {
        typedef const char *(*fn_t)(void);
        fn_t fn = (fn_t)kvdd_test_double_symbol("kvdd_testdouble_last_error");
        if (fn == NULL) {
            fn = (fn_t)dlsym(RTLD_DEFAULT, "aclGetRecentErrMsg");
        }
        return fn == NULL ? NULL : fn();
    }
    /* Test double only: its _GLIBCXX_USE_CXX11_ABI; -1 when unknown. */
    static int kvdd_td_cxx11_abi(void) {
        typedef int (*fn_t)(void);
        fn_t fn = (fn_t)kvdd_test_double_symbol("kvdd_testdouble_cxx11_abi");
        return fn == NULL ? -1 : fn();
    }
    static int kvdd_cxx11_abi(void) { return _GLIBCXX_USE_CXX11_ABI; }
    static int kvdd_built_against_test_double(void) { return KVDD_TEST_DOUBLE; }
    /* Path of the loaded libllm_datadist.so, "" when unknown. */
    static std::string kvdd_library_path(void) {
        std::string path;
        void *handle = kvdd_library_handle();
        if (handle != NULL) {
            struct link_map *map = NULL;
            if (dlinfo(handle, RTLD_DI_LINKMAP, &map) == 0 && map != NULL && map->l_name != NULL) {
                path = map->l_name;
            }
            dlclose(handle);
        }
        return path;
    }
    """
    int kvdd_td_listen_port(void* dd) nogil
    int kvdd_td_cxx11_abi() nogil
    const char* kvdd_library_message() nogil
    int kvdd_cxx11_abi() nogil
    int kvdd_built_against_test_double() nogil
    string_t kvdd_library_path "kvdd_library_path"() except +


def header_constants():
    """Option keys and statuses as ``llm_datadist/llm_datadist.h`` defines them.

    Returns ``{name: value}`` for the eight ``OPTION_*`` keys and ``LLM_SUCCESS``/``LLM_FAILED``
    (compiled in from the header this module was built against), so tests and ``kvdd doctor``
    can compare them with :mod:`kvdd.options` and :class:`kvdd.Status`.
    """
    return {
        "OPTION_LISTEN_IP_INFO": _c_text(OPTION_LISTEN_IP_INFO),
        "OPTION_DEVICE_ID": _c_text(OPTION_DEVICE_ID),
        "OPTION_SYNC_CACHE_WAIT_TIME": _c_text(OPTION_SYNC_CACHE_WAIT_TIME),
        "OPTION_BUF_POOL_CFG": _c_text(OPTION_BUF_POOL_CFG),
        "OPTION_ENABLE_SET_ROLE": _c_text(OPTION_ENABLE_SET_ROLE),
        "OPTION_LOCAL_COMM_RES": _c_text(OPTION_LOCAL_COMM_RES),
        "OPTION_TRANSFER_BACKEND": _c_text(OPTION_TRANSFER_BACKEND),
        "OPTION_GLOBAL_RESOURCE_CONFIG": _c_text(OPTION_GLOBAL_RESOURCE_CONFIG),
        "LLM_SUCCESS": <uint32_t>LLM_SUCCESS,
        "LLM_FAILED": <uint32_t>LLM_FAILED,
    }


def build_info():
    """How this module was built and what it loaded.

    Keys: ``cxx11_abi`` (the ``_GLIBCXX_USE_CXX11_ABI`` it was compiled with), ``test_double``
    (built against kvdd's CI test double), ``test_double_cxx11_abi`` (the double's setting, None
    when not the double), ``library`` (path of the loaded ``libllm_datadist.so``, '' if unknown).
    """
    cdef string_t path = kvdd_library_path()
    double_abi = kvdd_td_cxx11_abi()
    return {
        "cxx11_abi": kvdd_cxx11_abi(),
        "test_double": bool(kvdd_built_against_test_double()),
        "test_double_cxx11_abi": None if double_abi < 0 else double_abi,
        "library": path.c_str()[:path.size()].decode("utf-8", "surrogateescape"),
    }
