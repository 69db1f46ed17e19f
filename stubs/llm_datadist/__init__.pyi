# Type checkers see `import llm_datadist` as kvdd's façade of CANN's package (kvdd.llm_datadist),
# which `kvdd cann-root` installs under that name and tests install with
# kvdd.llm_datadist.toplevel.install(); the client-shaped harnesses in tests/llm_datadist/clients
# are checked against it.
from kvdd.llm_datadist import *
from kvdd.llm_datadist import v2_list as v2_list
