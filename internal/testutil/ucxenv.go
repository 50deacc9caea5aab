package testutil

import (
	"os"
	"strings"
)

// UCXLoopbackEnv keeps a test's UCX traffic on loopback tcp (the only
// traffic tests may send) and UCX's log lines on stderr, off stdout where
// helper processes talk: KEY=VALUE pairs, for child processes' environments.
// "stderr" is UCX's name for the stream: a path such as /dev/stderr UCX
// opens with O_TRUNC, which empties the log file a test's output is
// redirected to, mid-run.
var UCXLoopbackEnv = []string{"UCX_TLS=tcp", "UCX_NET_DEVICES=lo", "UCX_LOG_FILE=stderr", "UCX_WARN_UNUSED_ENV_VARS=n"}

// SetUCXLoopbackEnv sets UCXLoopbackEnv in this process, each variable only
// where the environment does not set it already (a run may pick another
// transport or device). Call it from TestMain before UCX is loaded.
func SetUCXLoopbackEnv() {
	for _, kv := range UCXLoopbackEnv {
		k, v, _ := strings.Cut(kv, "=")
		if _, set := os.LookupEnv(k); !set {
			os.Setenv(k, v)
		}
	}
}
