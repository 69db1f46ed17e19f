# Included by _datadist.pyx (textually, sharing its cimports): the base class of NativeBackend --
# one C++ LlmDataDist instance and the state kept beside it (the kept owners, the listen port, this
# thread's failure detail), its construction and teardown, and its lifecycle calls (Initialize,
# Finalize, SetRole).  A Cython include cannot stand in a class body, hence a base class; the links,
# registrations and transfers stay in NativeBackend (_datadist.pyx).


cdef class _Instance:
    """The C++ instance behind :class:`NativeBackend` and the state kept beside it (see there)."""

    cdef LlmDataDist* _dd
    cdef shared_mutex* _mutex
    cdef dict _owners        # cache id -> TensorAddrs.owners kept alive while registered
    cdef list _orphans       # owners of registrations whose entry may remain (see register)
    cdef bint _initialized
    cdef bint _hixl
    cdef int _listen         # port parsed from llm.ListenIpInfo, -1 when not listening
    cdef object _local       # threading.local: .detail = this thread's last failure explanation

    def __cinit__(self, *args, **kwargs):
        self._dd = NULL
        self._mutex = new shared_mutex()
        self._owners = {}
        self._orphans = []
        self._initialized = False
        self._hixl = False
        self._listen = -1
        self._local = threading.local()

    def __init__(self, cluster_id, role):
        cdef uint64_t cid = _u64(cluster_id, "cluster_id")
        cdef int32_t r = _i32(role, "role")
        if self._dd != NULL:
            raise RuntimeError("NativeBackend is already constructed")
        try:
            with nogil:
                self._dd = new LlmDataDist(cid, <LlmRole>r)
        except Exception as exc:
            _raise_cxx("LlmDataDist", exc)

    def __dealloc__(self):
        # Upstream's destructor tears a still-initialized instance down; owners are released by
        # Cython after this returns, i.e. after the library has forgotten the memory.
        if self._dd != NULL:
            with nogil:
                del self._dd
            self._dd = NULL
        if self._mutex != NULL:
            del self._mutex
            self._mutex = NULL

    def __repr__(self):
        return f"<NativeBackend initialized={bool(self._initialized)} listen_port={self.listen_port}>"

    cdef LlmDataDist* _get(self) except NULL:
        if self._dd == NULL:
            raise RuntimeError("NativeBackend.__init__ was not called")
        self._local.detail = None   # a new call: forget the previous explanation
        self._local.fresh = True
        return self._dd

    cdef Status _cxx_failed(self, str call, object exc):
        """A C++ exception from ``call``: LLM_FAILED, with the C++ message kept as this thread's
        ``last_error_detail()``."""
        self._local.detail = _cxx_message(call, exc)
        return LLM_FAILED

    def last_error_detail(self):
        """The explanation of this thread's last non-success status, or None (API.md, Backend
        protocol).

        The message of a C++ exception the library threw (the call returned LLM_FAILED); else the
        library's own explanation of the failed call when it offers one (the simulated CANN root
        always does; on CANN, ACL's ``aclGetRecentErrMsg``), else None.  Meaningful right after
        the failed call, on its thread; reading it clears it.
        """
        cdef const char* text
        if not getattr(self._local, "fresh", False):
            return None
        self._local.fresh = False
        detail = self._local.detail
        self._local.detail = None
        if detail is None:
            text = kvdd_library_message()
            if text != NULL and text[0] != 0:
                detail = text.decode("utf-8", "replace")
        return detail

    # ---- lifecycle --------------------------------------------------------------------------

    def initialize(self, options):
        """``Initialize(options)``: option keys and values are str (SEMANTICS.md §3.2)."""
        cdef LlmDataDist* dd = self._get()
        cdef cpp_map[AscendString, AscendString] opts
        cdef Status st
        _fill_options(opts, options, "options")
        try:
            with nogil:
                self._mutex.lock_shared()
                try:
                    st = dd.Initialize(opts)
                finally:
                    self._mutex.unlock_shared()
        except Exception as exc:
            st = self._cxx_failed("Initialize", exc)
        if st == LLM_SUCCESS and not self._initialized:
            # An already initialized instance ignores new options (SEMANTICS.md §3.2 step 1).
            self._initialized = True
            backend = options.get(_c_text(OPTION_TRANSFER_BACKEND))
            self._hixl = backend == "hixl"
            listen = options.get(_c_text(OPTION_LISTEN_IP_INFO))
            self._listen = -1 if listen is None else _listen_port_of(listen)
        return st

    def finalize(self):
        """``Finalize()``: waits for calls in flight, then drops the owners kept so far."""
        cdef LlmDataDist* dd = self._get()
        # Swap the owner tables before the call: a registration that completes after Finalize
        # (in another thread) lands in the new table and stays alive; one in flight during it is
        # kept too (until the next unregister/finalize), which is safe.
        owners, orphans = self._owners, self._orphans
        self._owners, self._orphans = {}, []
        try:
            with nogil:
                self._mutex.lock()
                try:
                    dd.Finalize()
                    # Still exclusive: no call can observe the old state after Finalize.
                    self._initialized = False
                    self._hixl = False
                    self._listen = -1
                finally:
                    self._mutex.unlock()
        except Exception as exc:
            # State unknown: keep every owner (memory safety first).
            owners.update(self._owners)
            orphans.extend(self._orphans)
            self._owners, self._orphans = owners, orphans
            _raise_cxx("Finalize", exc)
        del owners, orphans   # released here, after the library forgot the memory

    def set_role(self, role, options):
        """``SetRole(role, options)``: role any int32; options may be empty (SEMANTICS.md §3.4)."""
        cdef LlmDataDist* dd = self._get()
        cdef int32_t r = _i32(role, "role")
        cdef cpp_map[AscendString, AscendString] opts
        cdef Status st
        _fill_options(opts, options, "options")
        try:
            with nogil:
                self._mutex.lock_shared()
                try:
                    st = dd.SetRole(<LlmRole>r, opts)
                finally:
                    self._mutex.unlock_shared()
        except Exception as exc:
            st = self._cxx_failed("SetRole", exc)
        if st == LLM_SUCCESS and not self._hixl:
            # comm backend: listen info (re)starts listening, its absence stops it.  The HIXL
            # backend never changes its listener (SEMANTICS.md §3.4 step 5).
            listen = None if options is None else options.get(_c_text(OPTION_LISTEN_IP_INFO))
            self._listen = -1 if listen is None else _listen_port_of(listen)
        return st

    @property
    def listen_port(self):
        """The TCP port this instance listens on, None when not listening.

        The real library has no call for it: the port comes from the ``llm.ListenIpInfo``
        accepted by ``Initialize``/``SetRole`` (low 16 bits); on a real CANN install the binding
        cannot learn which port 0 bound and reports 0 (choose a fixed port there).  A build
        against kvdd's simulated CANN root asks the root instead, which knows exactly (also for
        the internal listen keys and SetRole's normalized compares); ``KVDD_TESTDOUBLE_PORT_HOOK=0``
        turns that off so the build behaves like a real install (the conformance run "as on an
        Atlas node" sets it, so nothing in it relies on the hook).
        """
        if (self._dd != NULL and kvdd_built_against_test_double()
                and os.environ.get("KVDD_TESTDOUBLE_PORT_HOOK", "1") != "0"):
            port = kvdd_td_listen_port(<void*>self._dd)
            if port >= 0:
                return port
            if port == -1:
                return None
        if self._listen < 0:
            return None
        return self._listen
