"""The FastDeploy settings its cache transfer manager reads at import (its defaults)."""

FD_CACHE_PROC_EXIT_TIMEOUT = 3600
FD_CACHE_PROC_ERROR_COUNT = 10
FD_ENABLE_SWAP_SPACE_CLEARING = False
