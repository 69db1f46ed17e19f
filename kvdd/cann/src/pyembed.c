/*
 * kvdd's simulated CANN root: libkvdd_pyembed.so, which starts CPython inside a C++ program.
 *
 * Written by the kvdd project.  libllm_datadist.so loads it (after loading, RTLD_GLOBAL, the
 * libpython recorded in the root's marker) only when the process has no running interpreter.  It
 * starts the interpreter of the installation that wrote the root: sys.executable is that
 * installation's python (a venv's bin/python finds its pyvenv.cfg, site-packages and .pth files,
 * including an editable install's import hook), the PYTHON* environment variables are ignored (the
 * user sets no PYTHONPATH, and a stray PYTHONHOME must not redirect it), signal handlers are not
 * installed (like Py_InitializeEx(0): the C++ program keeps its own), and the GIL is released
 * afterwards so the simulator's listener threads run while the program is in its own code.
 * Compiled against the full C API of that Python (PyConfig), which is why it is a library of its
 * own: in a Python process it is never loaded.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdio.h>

__attribute__((visibility("default"))) int kvdd_pyembed_start(const char *python_executable,
                                                              char *error, size_t error_size) {
  PyConfig config;
  PyStatus status;
  PyConfig_InitPythonConfig(&config);
  config.install_signal_handlers = 0;
  config.parse_argv = 0;
  config.use_environment = 0;
  config.user_site_directory = 0;
  status = PyConfig_SetBytesString(&config, &config.program_name, python_executable);
  if (!PyStatus_Exception(status)) {
    status = PyConfig_SetBytesString(&config, &config.executable, python_executable);
  }
  if (!PyStatus_Exception(status)) {
    status = Py_InitializeFromConfig(&config);
  }
  PyConfig_Clear(&config);
  if (PyStatus_Exception(status)) {
    snprintf(error, error_size, "starting the Python interpreter %s failed: %s%s%s",
             python_executable, status.func != NULL ? status.func : "",
             status.func != NULL ? ": " : "", status.err_msg != NULL ? status.err_msg : "?");
    return -1;
  }
  (void)PyEval_SaveThread(); /* release the GIL; calls take it with PyGILState_Ensure */
  return 0;
}
