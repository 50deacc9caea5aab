package store

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/bundle"
	"github.com/cudaipc/cudaipc/internal/testutil"
	"github.com/cudaipc/cudaipc/protocol"
	"github.com/cudaipc/cudaipc/protocol/storev1"
)

// wantLimit checks that resp is a LIMIT error of the given kind whose
// message names the serve flag that sets it.
func wantLimit(t *testing.T, resp *storev1.Response, limit storev1.Error_Limit, flag string) {
	t.Helper()
	e := resp.GetError()
	if e.GetCode() != storev1.Error_LIMIT || e.GetLimit() != limit || !strings.Contains(e.GetMessage(), flag) {
		t.Fatalf("got %v %v (%s), want LIMIT %v naming %s", e.GetCode(), e.GetLimit(), e.GetMessage(), limit, flag)
	}
}

// Registrations are accepted only for GPUs the daemon has: a host-only
// daemon refuses every GPU registration, a cuda one a GPU it lacks.
func TestRegisterOnlyOnDevicesTheDaemonHas(t *testing.T) {
	f := memfdPiece(t, make([]byte, 32))
	defer f.Close()
	r := &storev1.RegisterRequest{Name: "w", Size: 1 << 20, Device: testGPU, Region: vmmRegion(t, 0, 1<<20, 2<<20), Files: 1}
	_, hostPath, _ := serve(t, Config{})
	if resp := dialRaw(t, hostPath).register(r, f); code(resp) != storev1.Error_INVALID || !strings.Contains(resp.GetError().GetMessage(), "no GPU backend") {
		t.Errorf("register on a host-only daemon: %v (%s), want INVALID", code(resp), resp.GetError().GetMessage())
	}
	_, gpuPath, _ := serveGPU(t, Config{})
	other := &storev1.RegisterRequest{Name: "w", Size: 1 << 20, Device: "GPU-00000000-1111-2222-3333-444444444444", Region: vmmRegion(t, 0, 1<<20, 2<<20), Files: 1}
	c := dialRaw(t, gpuPath)
	if resp := c.register(other, f); code(resp) != storev1.Error_INVALID || !strings.Contains(resp.GetError().GetMessage(), "no such GPU") {
		t.Errorf("register on a GPU the daemon lacks: %v (%s), want INVALID", code(resp), resp.GetError().GetMessage())
	}
	wantCode(t, c.register(r, f), storev1.Error_OK)
}

// The descriptors the daemon keeps for a uid (registrations' pieces, host
// arenas, manifests) are bounded, and given back when what holds them goes.
func TestDescriptorsBoundedPerUID(t *testing.T) {
	s, path, _ := serveGPU(t, Config{MaxFDsPerUID: 6, MaxFDs: 100})
	c := dialRaw(t, path)
	pieces := func(n int) []*os.File {
		var fs []*os.File
		for range n {
			f := memfdPiece(t, []byte("x"))
			t.Cleanup(func() { f.Close() })
			fs = append(fs, f)
		}
		return fs
	}
	reg := func(name string, n int) *storev1.Response {
		sizes := make([]int64, n)
		for i := range sizes {
			sizes[i] = 2 << 20
		}
		return c.register(&storev1.RegisterRequest{Name: name, Size: 1 << 20, Device: testGPU, Region: vmmRegion(t, 0, 1<<20, sizes...), Files: uint32(n)}, pieces(n)...)
	}
	wantCode(t, reg("a", 4), storev1.Error_OK)
	wantLimit(t, reg("b", 3), storev1.Error_DESCRIPTORS_PER_UID, "max-fds-per-uid setting")
	if _, c := c.stat("b"); c != storev1.Error_NOT_FOUND {
		t.Fatalf("a refused registration left its name: %v", c)
	}
	// A private host arena takes two: 4 + 2 = 6.
	c.put("obj", 4096, false)
	// A manifest takes one more: over.
	resp, files := c.do(req(&storev1.CreateRequest{Name: "bundle", Size: 4096, ManifestSize: 64}))
	protocol.CloseFiles(files)
	wantLimit(t, resp, storev1.Error_DESCRIPTORS_PER_UID, "max-fds-per-uid setting")
	resp, _ = c.do(req(&storev1.DeleteRequest{Name: "a"}))
	wantCode(t, resp, storev1.Error_OK)
	wantCode(t, reg("b", 3), storev1.Error_OK)
	s.mu.Lock()
	fds := s.fds
	s.mu.Unlock()
	if fds != 5 {
		t.Errorf("the daemon counts %d descriptors kept, want 5 (3 pieces, one arena)", fds)
	}
	// Staged descriptors count too, and a refused stage drops the staged.
	resp, _ = c.sendFiles(stageReq(), pieces(1)...)
	wantCode(t, resp, storev1.Error_OK)
	resp, _ = c.sendFiles(stageReq(), pieces(1)...)
	wantLimit(t, resp, storev1.Error_DESCRIPTORS_PER_UID, "max-fds-per-uid setting")
	s.mu.Lock()
	fds = s.fds
	s.mu.Unlock()
	if fds != 5 {
		t.Errorf("after a refused stage the daemon counts %d descriptors kept, want 5", fds)
	}
}

// A uid's objects are bounded over all its connections, drafts included;
// deleting makes room again.
func TestObjectsBoundedPerUID(t *testing.T) {
	s := newTestStore(t, Config{MaxObjectsPerUID: 3})
	a, b := connect(t, s, 1000), connect(t, s, 1000)
	other := connect(t, s, 1001)
	a.put("one", 10, false)
	if _, err := a.ss.createObject("draft", 10, "", false); err != nil {
		t.Fatal(err)
	}
	b.put("two", 10, true)
	_, err := b.ss.createObject("three", 10, "", false)
	if protocol.CodeOf(err) != storev1.Error_LIMIT || protocol.LimitOf(err) != storev1.Error_OBJECTS_PER_UID || !strings.Contains(err.Error(), "max-objects-per-uid setting") {
		t.Fatalf("a fourth object of uid 1000: %v", err)
	}
	other.put("theirs", 10, false) // another uid is not held up
	if err := a.ss.abortName("draft"); err != nil {
		t.Fatal(err)
	}
	b.put("three", 10, false)
}

// An admitted client that sends bad packets on connection after
// connection costs the log a burst of lines, then lines at a bounded rate
// with the count held back; another uid's lines are not held back by it.
func TestClientLogLinesRateLimitedPerUID(t *testing.T) {
	var logs logBuffer
	s, path, _ := serve(t, Config{Logger: logs.logger()})
	const floods = 200
	t0 := time.Now()
	for range floods {
		c := dialRaw(t, path)
		// A packet that does not decode closes the connection with a WARN.
		if _, err := c.uc.Write([]byte{0xff, 0xff, 0xff}); err != nil {
			t.Fatal(err)
		}
		var b [64]byte
		c.uc.Read(b[:]) // the close
		c.c.Close()
	}
	testutil.Eventually(t, testutil.Wait, func() error {
		if n := strings.Count(logs.String(), "closing connection: bad packet"); n < clientLogBurst {
			return fmt.Errorf("%d bad-packet lines logged, want the burst of %d first", n, clientLogBurst)
		}
		return nil
	})
	// The burst, then one line a second.
	if n, bound := strings.Count(logs.String(), "closing connection: bad packet"), clientLogBurst+int(time.Since(t0)/clientLogEvery)+1; n > bound {
		t.Errorf("%d bad-packet lines for %d bad packets in %v, want at most %d", n, floods, time.Since(t0), bound)
	}
	s.logFor(4242).Warn("another uid's line")
	if !strings.Contains(logs.String(), "another uid's line") {
		t.Error("another uid's line was held back")
	}
}

// A create with no_evict fails with STORE_FULL rather than evict; the
// same create without it evicts.
func TestCreateNoEvict(t *testing.T) {
	s := newTestStore(t, Config{Capacity: 64 << 10})
	c := connect(t, s, 1000)
	c.put("old", 48<<10, false)
	_, _, err := c.ss.create(createReq{name: "new", size: 32 << 10, noEvict: true})
	if !errors.Is(err, ErrStoreFull) || !strings.Contains(err.Error(), "no_evict") {
		t.Fatalf("a no_evict create that needs room: %v", err)
	}
	if _, err := c.ss.stat("old"); err != nil {
		t.Fatalf("a no_evict create evicted: %v", err)
	}
	if _, _, err := c.ss.create(createReq{name: "new", size: 32 << 10}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.ss.stat("old"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("a plain create that needs room did not evict: %v", err)
	}
}

// A no-copy version counts against its publisher's objects and keeps its
// descriptors charged until it goes.
func TestNoCopyVersionsCounted(t *testing.T) {
	s, path, _ := serve(t, Config{MaxObjectsPerUID: 1})
	pub := dialRaw(t, path)
	piece := memfdPiece(t, make([]byte, 32))
	defer piece.Close()
	nc := newNoCopy(t, vmmRegion(t, 0, 2<<20, 2<<20))
	pub.publishNoCopy("policy", nc, 1, piece)
	s.mu.Lock()
	objects, fds := s.usage[uint32(os.Geteuid())].objects, s.fds
	s.mu.Unlock()
	if objects != 1 || fds != 2 {
		t.Fatalf("a no-copy version counts %d objects and %d descriptors, want 1 and 2 (its manifest, its piece)", objects, fds)
	}
	r := pub.createNoCopy("policy", nc, 1, piece)
	wantLimit(t, r.resp, storev1.Error_OBJECTS_PER_UID, "max-objects-per-uid setting")
	resp, _ := pub.do(req(&storev1.DeleteRequest{Name: "policy"}))
	wantCode(t, resp, storev1.Error_OK)
	s.mu.Lock()
	u, fds := s.usage[uint32(os.Geteuid())], s.fds
	s.mu.Unlock()
	if u != nil || fds != 0 {
		t.Fatalf("after the delete: usage %+v, %d descriptors", u, fds)
	}
}

// An evicted bundle gives back its manifest's descriptor with its memory,
// as a deleted one does.
func TestEvictedBundleGivesBackItsManifest(t *testing.T) {
	s := newTestStore(t, Config{Capacity: 64 << 10})
	c := connect(t, s, 1000)
	specs := []bundle.Spec{{Name: "w", DType: "F32", Shape: []int64{8192}}}
	man, size, err := bundle.Layout(specs, 0, nil)
	if err != nil {
		t.Fatal(err)
	}
	raw := man.Marshal()
	p, _, err := c.ss.create(createReq{name: "bundle", size: size, manifestSize: int64(len(raw))})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.manifest.WriteAt(raw, 0); err != nil {
		t.Fatal(err)
	}
	copy(c.mapping(p), randomBytes(size)) // closes the placement's descriptors
	if err := c.ss.sealName("bundle"); err != nil {
		t.Fatal(err)
	}
	fds := func() int {
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.fds
	}
	before := fds()
	c.put("big", 48<<10, false) // evicts the bundle
	if _, err := c.ss.stat("bundle"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("the bundle was not evicted: %v", err)
	}
	if got := fds(); got != before-1 {
		t.Fatalf("the daemon keeps %d descriptors after the bundle's eviction, want %d (its manifest's given back)", got, before-1)
	}
}
