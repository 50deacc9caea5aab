package protocol

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cudaipc/cudaipc/protocol/storev1"
	"golang.org/x/sys/unix"
)

// TestPythonClientFromDoc runs the Python client printed in
// docs/protocol.md against a minimal server built from this package, so
// that the document and the code cannot drift apart.
func TestPythonClientFromDoc(t *testing.T) {
	python, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("python3 not installed: cannot check the documented client")
	}
	doc, err := os.ReadFile(filepath.Join("..", "docs", "protocol.md"))
	if err != nil {
		t.Fatal(err)
	}
	_, block, ok := strings.Cut(string(doc), "<!-- begin python client -->\n```python\n")
	block, _, ok2 := strings.Cut(block, "```\n<!-- end python client -->")
	if !ok || !ok2 {
		t.Fatal("docs/protocol.md: python client block not found")
	}
	script := filepath.Join(t.TempDir(), "client.py")
	if err := os.WriteFile(script, []byte(block), 0o600); err != nil {
		t.Fatal(err)
	}

	const offset, arenaSize = 4096, 8 << 20
	fd, err := unix.MemfdCreate("doc-arena", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	arena := os.NewFile(uintptr(fd), "doc-arena")
	defer arena.Close()
	if err := arena.Truncate(arenaSize); err != nil {
		t.Fatal(err)
	}
	serverErr := make(chan error, 1)
	var objSize uint64
	path := fakeServer(t, func(c *Conn) {
		serverErr <- serveDocClient(c, arena, offset, arenaSize, &objSize)
	})

	var stdout bytes.Buffer
	cmd := exec.CommandContext(context.Background(), python, script, path)
	cmd.Stdout = &stdout
	cmd.Stderr = os.Stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("python client: %v", err)
	}
	if err := <-serverErr; err != nil {
		t.Fatalf("server: %v", err)
	}
	data := make([]byte, objSize)
	if _, err := arena.ReadAt(data, offset); err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(data)
	if got := strings.TrimSpace(stdout.String()); got != hex.EncodeToString(sum[:]) {
		t.Fatalf("python wrote bytes with sha256 %s, the arena holds %x", got, sum)
	}
	if bytes.Count(data, []byte{0}) > len(data)/128 {
		t.Fatal("the arena holds mostly zeros, not the client's random bytes")
	}
}

// serveDocClient plays the store for the documented client: every request
// must pass ValidateRequest and come in the documented order.
func serveDocClient(c *Conn, arena *os.File, offset, arenaSize uint64, objSize *uint64) error {
	ro, err := os.Open(fmt.Sprintf("/proc/self/fd/%d", arena.Fd()))
	if err != nil {
		return err
	}
	defer ro.Close()
	want := []string{"hello", "create", "seal", "get", "release", "stat"}
	for i := 0; ; i++ {
		var req storev1.Request
		files, err := c.Recv(&req)
		if errors.Is(err, io.EOF) && i == len(want) {
			return nil
		}
		if err != nil {
			return err
		}
		CloseFiles(files)
		if err := ValidateRequest(&req, len(files)); err != nil {
			return fmt.Errorf("request %d (%v): %w", i, &req, err)
		}
		if i >= len(want) || RequestKind(&req) != want[i] {
			return fmt.Errorf("request %d is %s, want %s", i, RequestKind(&req), want[min(i, len(want)-1)])
		}
		resp := &storev1.Response{Id: req.GetId()}
		var attach []*os.File
		switch b := req.GetBody().(type) {
		case *storev1.Request_Hello:
			if err := CheckVersion(b.Hello.GetVersion()); err != nil {
				return err
			}
			resp.Body = &storev1.Response_Hello{Hello: &storev1.HelloResponse{Version: Version, ServerVersion: "doc-test", Pid: uint32(os.Getpid()), Backend: "host"}}
		case *storev1.Request_Create:
			*objSize = b.Create.GetSize()
			resp.Body = &storev1.Response_Create{Create: &storev1.CreateResponse{Placement: &storev1.Placement{
				Kind: storev1.Placement_HOST, ArenaId: 1, Device: "host", Offset: offset, Size: *objSize, ArenaSize: arenaSize, Writable: true, FdAttached: true}}}
			attach = []*os.File{arena}
		case *storev1.Request_Seal:
			resp.Body = &storev1.Response_Seal{Seal: &storev1.SealResponse{}}
		case *storev1.Request_Get:
			if b.Get.GetTimeoutMs() != 5000 {
				return fmt.Errorf("get timeout_ms = %d", b.Get.GetTimeoutMs())
			}
			resp.Body = &storev1.Response_Get{Get: &storev1.GetResponse{LeaseId: 7,
				Placement: &storev1.Placement{Kind: storev1.Placement_HOST, ArenaId: 1, Device: "host", Offset: offset, Size: *objSize, ArenaSize: arenaSize, FdAttached: true},
				Info:      &storev1.ObjectInfo{Name: b.Get.GetName(), Size: *objSize, Device: "host", Sealed: true, Leases: 1, OwnerUid: uint32(os.Getuid())}}}
			attach = []*os.File{ro}
		case *storev1.Request_Release:
			if b.Release.GetLeaseId() != 7 {
				return fmt.Errorf("release of lease %d", b.Release.GetLeaseId())
			}
			resp.Body = &storev1.Response_Release{Release: &storev1.ReleaseResponse{}}
		case *storev1.Request_Stat:
			resp = ErrorResponse(req.GetId(), Errorf(storev1.Error_NOT_FOUND, "no object %q", b.Stat.GetName()))
		}
		if err := ValidateResponse(resp, len(attach)); err != nil {
			return err
		}
		if err := c.Send(resp, attach...); err != nil {
			return err
		}
	}
}
