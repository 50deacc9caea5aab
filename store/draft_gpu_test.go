package store

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"

	"testing"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/internal/testutil"
)

// arenaReaderHelper imports the region in the file $ARENA_REGION (a whole
// GPU arena, as a placement sends it) and checks what another uid's
// mapping of it shows: the bytes of $ARENA_WANT at $ARENA_OFFSET, zeros
// elsewhere, and none of the 64-byte patterns of $ARENA_SECRETS.
func arenaReaderHelper() int {
	read := func(env string) []byte {
		b, err := os.ReadFile(os.Getenv(env))
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		return b
	}
	var r cudaipc.Region
	if err := r.UnmarshalBinary(read("ARENA_REGION")); err != nil {
		fmt.Fprintln(os.Stderr, "region:", err)
		return 2
	}
	var opts []cudaipc.ImportOption
	if os.Getenv("ARENA_FD") != "" {
		// A vmm-fd region: its descriptor came along, as fd 3.
		opts = append(opts, cudaipc.WithFile(os.NewFile(3, "arena")))
	}
	m, err := cudaipc.Import(r, opts...)
	if err != nil {
		fmt.Fprintln(os.Stderr, "import:", err)
		return 2
	}
	defer m.Close()
	whole := make([]byte, m.Size())
	if _, err := m.ReadAt(whole, 0); err != nil {
		fmt.Fprintln(os.Stderr, "read:", err)
		return 2
	}
	want := read("ARENA_WANT")
	var off int
	fmt.Sscan(os.Getenv("ARENA_OFFSET"), &off)
	if !bytes.Equal(whole[off:off+len(want)], want) {
		fmt.Fprintln(os.Stderr, "the object's bytes differ")
		return 1
	}
	secrets := read("ARENA_SECRETS")
	for i := 0; i+64 <= len(secrets); i += 64 {
		if bytes.Contains(whole, secrets[i:i+64]) {
			fmt.Fprintf(os.Stderr, "secret %d is readable in the arena\n", i/64)
			return 1
		}
	}
	rest := append(bytes.Clone(whole[:off]), whole[off+len(want):]...)
	if i := bytes.IndexFunc(rest, func(r rune) bool { return r != 0 }); i >= 0 {
		fmt.Fprintf(os.Stderr, "the arena beyond the object is not zero (byte %d of the rest)\n", i)
		return 1
	}
	return 0
}

// TestGPUSharedDraftsUnreachable is TestSharedDraftsUnreachable on the
// cuda backend, with GPU arenas shared by legacy IPC and by descriptor:
// another uid's reader imports the whole arena of a shared GPU object, as
// the placement lets it, and must find the object and zeros: no draft,
// aborted draft, private object or leftover of a freed arena of the owner.
func TestGPUSharedDraftsUnreachable(t *testing.T) {
	dev := testutil.RequireGPU(t)
	for _, share := range []string{GPUShareIPC, GPUShareFD} {
		t.Run(share, func(t *testing.T) {
			if share == GPUShareFD && !dev.VMMFDSupported() {
				t.Skip("the GPU cannot export memory as file descriptors")
			}
			gpuDraftsUnreachable(t, dev, share)
		})
	}
}

func gpuDraftsUnreachable(t *testing.T, dev *cudaipc.Device, share string) {
	s := newTestStore(t, Config{Backend: "cuda", GPUShare: share})
	gpu := dev.UUID().String()
	owner, reader := connect(t, s, 1000), connect(t, s, 65534)
	write := func(p placement, data []byte) {
		t.Helper()
		s.mu.Lock()
		ar := s.devices[gpu].arenas[p.arenaID].(*gpuArena)
		s.mu.Unlock()
		if _, err := ar.mem.(interface {
			WriteAt([]byte, int64) (int, error)
		}).WriteAt(data, p.offset); err != nil {
			t.Fatal(err)
		}
	}
	var secrets []byte
	create := func(name string, size int64, shared bool) (placement, []byte) {
		t.Helper()
		p, err := owner.ss.createObject(name, size, gpu, shared)
		if err != nil {
			t.Fatalf("create %s: %v", name, err)
		}
		data := randomBytes(size)
		write(p, data)
		secrets = append(secrets, data[:64]...)
		return p, data
	}
	// A private object that is deleted: its arena goes back to the
	// driver, which may hand the memory out again.
	create("old", 48<<20, false)
	if err := owner.ss.abortName("old"); err != nil {
		t.Fatal(err)
	}
	create("draft", 3<<20, true)
	create("aborted", 1<<20, true)
	if err := owner.ss.abortName("aborted"); err != nil {
		t.Fatal(err)
	}
	create("private", 1<<20, false)
	if err := owner.ss.sealName("private"); err != nil {
		t.Fatal(err)
	}
	p, pub := create("pub", 1<<20+4321, true)
	secrets = secrets[:len(secrets)-64]
	if err := owner.ss.sealName("pub"); err != nil {
		t.Fatal(err)
	}
	lp, err := reader.ss.getName(context.Background(), "pub", false)
	if err != nil {
		t.Fatal(err)
	}
	defer lp.closeShare()
	if lp.arenaID != p.arenaID || len(lp.region) == 0 {
		t.Fatalf("reader's placement: %+v", lp)
	}
	dir := t.TempDir()
	files := map[string][]byte{"region": lp.region, "want": pub, "secrets": secrets}
	for name, b := range files {
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), helperEnv+"=arena-reader",
		"ARENA_REGION="+filepath.Join(dir, "region"), "ARENA_WANT="+filepath.Join(dir, "want"),
		"ARENA_SECRETS="+filepath.Join(dir, "secrets"), fmt.Sprintf("ARENA_OFFSET=%d", lp.offset))
	if lp.share != nil && lp.share.file != nil {
		cmd.ExtraFiles = []*os.File{lp.share.file}
		cmd.Env = append(cmd.Env, "ARENA_FD=3")
	} else if share == GPUShareFD {
		t.Fatal("a placement of a descriptor-shared arena without its descriptor")
	}
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("reader of uid 65534's view of the arena: %v\n%s", err, out)
	}
}
