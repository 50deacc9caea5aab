package cli

import (
	"encoding/json"
	"os"
	"os/exec"
	"testing"

	"github.com/cudaipc/cudaipc/transport/ucx"
)

// bench cluster runs two daemons and a private etcd, pulls every object
// with its bytes intact, and reports the figures it promises.
func TestBenchCluster(t *testing.T) {
	if _, err := exec.LookPath("etcd"); err != nil && os.Getenv("CUDAIPC_ETCD") == "" {
		msg := "no etcd binary (apt-get install etcd-server, or set CUDAIPC_ETCD)"
		if os.Getenv("CUDAIPC_REQUIRE_CLUSTER") == "1" {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	if err := ucx.Available(); err != nil {
		t.Skip(err)
	}
	for _, read := range []string{"fetch", "get"} {
		benchCluster(t, read)
	}
}

// benchCluster runs bench cluster with the daemons reading by read and
// checks its JSON.
func benchCluster(t *testing.T, read string) {
	t.Helper()
	out := mustRun(t, "bench", "cluster", "--size", "8MiB", "--count", "20", "--read", read, "--json")
	var r struct {
		Read       string  `json:"read"`
		LargeGBps  float64 `json:"large_GBps"`
		LargeEqual bool    `json:"large_bytes_equal"`
		SmallEqual bool    `json:"small_bytes_equal"`
		SmallCount int     `json:"small_count"`
		SmallP50   float64 `json:"small_p50_us"`
		SmallP99   float64 `json:"small_p99_us"`
		Inline     int     `json:"small_inline"`
		LocalP50   float64 `json:"local_p50_us"`
	}
	if err := json.Unmarshal([]byte(out), &r); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	if r.Read != read || !r.LargeEqual || !r.SmallEqual || r.SmallCount != 20 || r.LargeGBps <= 0 || r.SmallP50 <= 0 || r.SmallP99 < r.SmallP50 ||
		r.Inline != 20 || r.LocalP50 <= 0 {
		t.Fatalf("bench cluster: %s", out)
	}
}
