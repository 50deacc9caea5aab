package cli

import (
	"bytes"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// doctor says which libucp it checked and why: --ucx-lib naming a missing
// library is a warning (the daemon can still run alone) naming the path
// and the flag; without it, the default or $CUDAIPC_LIBUCP.
func TestDoctorUCXLibrary(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "libucp.so.0")
	for _, tc := range []struct {
		args     []string
		env      string
		wantWhy  string
		wantPath string
		notFound bool
	}{
		{args: []string{"--ucx-lib", missing}, wantWhy: "chosen by --ucx-lib", wantPath: missing, notFound: true},
		{env: "CUDAIPC_LIBUCP=" + missing, wantWhy: "chosen by $CUDAIPC_LIBUCP", wantPath: missing, notFound: true},
	} {
		cmd := exec.Command(os.Args[0], append([]string{"doctor", "--json", "--socket", filepath.Join(t.TempDir(), "none.sock")}, tc.args...)...)
		cmd.Env = append(os.Environ(), mainEnv+"=1", "CUDAIPC_LIBCUDA="+filepath.Join(t.TempDir(), "libcuda.so.1"))
		if tc.env != "" {
			cmd.Env = append(cmd.Env, tc.env)
		}
		var stdout, stderr bytes.Buffer
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		if err := cmd.Run(); err != nil {
			t.Fatalf("doctor %v: %v\n%s%s", tc.args, err, stdout.String(), stderr.String())
		}
		var checks []struct{ Name, Status, Detail string }
		if err := json.Unmarshal(stdout.Bytes(), &checks); err != nil {
			t.Fatalf("%v:\n%s", err, stdout.String())
		}
		var got *struct{ Name, Status, Detail string }
		for i := range checks {
			if checks[i].Name == "ucx" {
				got = &checks[i]
			}
		}
		if got == nil {
			t.Fatalf("no ucx check in %+v", checks)
		}
		if got.Status != "warn" || !strings.Contains(got.Detail, tc.wantWhy) || !strings.Contains(got.Detail, tc.wantPath) ||
			!strings.Contains(got.Detail, "single-node") {
			t.Errorf("doctor %v %s: ucx check %+v", tc.args, tc.env, *got)
		}
	}
}
