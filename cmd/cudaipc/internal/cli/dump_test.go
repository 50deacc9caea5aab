package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cudaipc/cudaipc"
)

func runCLI(args ...string) (stdout, stderr string, err error) {
	var o, e bytes.Buffer
	err = Run(context.Background(), args, &o, &e)
	return o.String(), e.String(), err
}

func TestDumpRejectsBadRegions(t *testing.T) {
	dir := t.TempDir()
	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"not json", []string{"dump", "--region", "{nope"}, "invalid region"},
		{"missing field", []string{"dump", "--region", `{"version":1,"kind":"cuda-ipc"}`}, "handle"},
		{"missing file", []string{"dump", "--region", "@" + filepath.Join(dir, "none.json")}, "no such file"},
		{"bad chunk", []string{"dump", "--region", "{}", "--chunk", "0"}, "--chunk"},
	} {
		_, _, err := runCLI(tc.args...)
		if err == nil || !strings.Contains(err.Error(), tc.want) || ExitCode(err) != 2 {
			t.Errorf("%s: %v (exit %d), want %q", tc.name, err, ExitCode(err), tc.want)
		}
	}
}

// A region from another boot fails before any driver call, with the reason.
func TestDumpOtherHost(t *testing.T) {
	id, err := cudaipc.SelfIdentity()
	if err != nil {
		t.Skip(err)
	}
	u, _ := cudaipc.ParseUUID("GPU-5f1c2a3b-4d5e-6f70-8192-a3b4c5d6e7f8")
	r := cudaipc.Region{Version: 1, Kind: cudaipc.KindCUDAIPC, Handle: cudaipc.MemHandle{1}, Size: 10, AllocSize: 10,
		Device: u, ExporterPID: 1, PIDNamespace: id.PIDNamespace, BootID: cudaipc.BootID{1}, BufferID: 1, ExporterBase: 0x1000}
	if r.BootID == id.BootID {
		r.BootID[1] = 1
	}
	b, err := json.Marshal(r)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "r.json")
	if err := os.WriteFile(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(t.TempDir(), "out.bin")
	_, _, err = runCLI("dump", "--region", "@"+path, "-o", out)
	if !errors.Is(err, cudaipc.ErrOtherHost) {
		t.Fatalf("dump of another host's region: %v", err)
	}
	if _, serr := os.Stat(out); !os.IsNotExist(serr) {
		t.Fatal("a failed dump left the output file")
	}
	entries, _ := os.ReadDir(filepath.Dir(out))
	if len(entries) != 0 {
		t.Fatalf("a failed dump left %v", entries)
	}
}
