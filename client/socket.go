package client

import (
	"os"
	"path/filepath"
	"strconv"
)

// DefaultSocketPath returns the socket path used when none is given:
// $CUDAIPC_SOCKET if set; else $XDG_RUNTIME_DIR/cudaipc/store.sock; else
// /run/cudaipc/store.sock for root and /tmp/cudaipc-<uid>/store.sock for
// other users.
func DefaultSocketPath() string {
	if p := os.Getenv("CUDAIPC_SOCKET"); p != "" {
		return p
	}
	if d := os.Getenv("XDG_RUNTIME_DIR"); d != "" {
		return filepath.Join(d, "cudaipc", "store.sock")
	}
	uid := os.Getuid()
	if uid == 0 {
		return "/run/cudaipc/store.sock"
	}
	return filepath.Join(os.TempDir(), "cudaipc-"+strconv.Itoa(uid), "store.sock")
}
