package store

import (
	"bytes"
	"context"
	"errors"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/internal/seeddata"
	"github.com/cudaipc/cudaipc/protocol"
	"golang.org/x/sys/unix"
)

// testClient is an in-process session plus the arena mappings a real
// client would cache.
type testClient struct {
	t    *testing.T
	ss   *session
	maps map[sentKey][]byte
}

func newTestStore(t testing.TB, cfg Config) *Store {
	t.Helper()
	if cfg.Backend == "" {
		// The same on every machine: auto would pick cuda on a GPU one.
		cfg.Backend = "host"
	}
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

func connect(t *testing.T, s *Store, uid uint32) *testClient {
	t.Helper()
	ss, err := s.newSession(context.Background(), peer{pid: int32(os.Getpid()), uid: uid, gid: uid})
	if err != nil {
		t.Fatal(err)
	}
	c := &testClient{t: t, ss: ss, maps: make(map[sentKey][]byte)}
	t.Cleanup(func() {
		c.ss.close(errSessionClosed)
		for _, m := range c.maps {
			unix.Munmap(m)
		}
	})
	return c
}

// mapping maps (or finds the cached mapping of) a placement's arena, and
// returns the object's bytes.
func (c *testClient) mapping(p placement) []byte {
	c.t.Helper()
	k := sentKey{p.arenaID, p.writable}
	if p.share != nil {
		if _, ok := c.maps[k]; ok {
			c.t.Fatalf("arena %d sent twice in mode writable=%v", p.arenaID, p.writable)
		}
		prot := unix.PROT_READ
		if p.writable {
			prot |= unix.PROT_WRITE
		}
		m, err := unix.Mmap(int(p.share.file.Fd()), 0, int(p.arenaSize), prot, unix.MAP_SHARED)
		p.closeShare()
		if err != nil {
			c.t.Fatalf("mmap arena %d: %v", p.arenaID, err)
		}
		c.maps[k] = m
	}
	m, ok := c.maps[k]
	if !ok {
		c.t.Fatalf("arena %d (writable=%v) was never sent", p.arenaID, p.writable)
	}
	return m[p.offset : p.offset+p.size]
}

// put creates, fills with random bytes and seals an object.
func (c *testClient) put(name string, size int64, shared bool) []byte {
	c.t.Helper()
	p, err := c.ss.createObject(name, size, "", shared)
	if err != nil {
		c.t.Fatalf("create %q: %v", name, err)
	}
	data := randomBytes(size)
	copy(c.mapping(p), data)
	if err := c.ss.sealName(name); err != nil {
		c.t.Fatalf("seal %q: %v", name, err)
	}
	return data
}

func (c *testClient) get(name string) (placement, []byte) {
	c.t.Helper()
	p, err := c.ss.getName(context.Background(), name, false)
	if err != nil {
		c.t.Fatalf("get %q: %v", name, err)
	}
	return p, c.mapping(p)
}

var seed atomic.Uint64

// randomBytes returns n bytes of a new seed's stream.
func randomBytes(n int64) []byte { return seeddata.Bytes(seed.Add(1), int(n)) }

func wantErr(t *testing.T, err, want error) {
	t.Helper()
	if !errors.Is(err, want) {
		t.Fatalf("err = %v, want %v", err, want)
	}
}

func TestSealedBytesVisibleToReader(t *testing.T) {
	s := newTestStore(t, Config{})
	w, r := connect(t, s, 1000), connect(t, s, 1000)

	p, err := w.ss.createObject("x", 100_000, "host", false)
	if err != nil {
		t.Fatal(err)
	}
	data := randomBytes(100_000)
	copy(w.mapping(p), data)

	// Unsealed: only the creator sees it.
	if _, err := r.ss.getName(context.Background(), "x", false); !errors.Is(err, ErrTimeout) {
		t.Fatalf("get of an unsealed object: %v, want ErrTimeout", err)
	}
	_, err = r.ss.stat("x")
	wantErr(t, err, ErrNotFound)
	if l := r.ss.list(""); len(l) != 0 {
		t.Fatalf("reader lists %v before seal", l)
	}
	wantErr(t, r.ss.sealName("x"), ErrNotFound)
	wantErr(t, r.ss.delete("x"), ErrNotFound)
	if in, err := w.ss.stat("x"); err != nil || in.Sealed || in.Size != 100_000 {
		t.Fatalf("creator's stat: %+v, %v", in, err)
	}
	_, err = r.ss.createObject("x", 10, "", false)
	wantErr(t, err, ErrExists)

	if err := w.ss.sealName("x"); err != nil {
		t.Fatal(err)
	}
	wantErr(t, w.ss.sealName("x"), ErrSealed)
	wantErr(t, w.ss.abortName("x"), ErrSealed)

	lp, got := r.get("x")
	if !bytes.Equal(got, data) {
		t.Fatal("reader sees other bytes than the creator wrote")
	}
	if lp.writable || lp.leaseID == 0 || lp.info.Leases != 1 || !lp.info.Sealed {
		t.Fatalf("lease placement %+v", lp)
	}
	// A second get of the same arena does not resend it.
	lp2, got2 := r.get("x")
	if lp2.share != nil || !bytes.Equal(got2, data) || lp2.leaseID == lp.leaseID {
		t.Fatalf("second lease %+v", lp2)
	}
	if in, _ := r.ss.stat("x"); in.Leases != 2 {
		t.Fatalf("leases = %d, want 2", in.Leases)
	}
	for _, id := range []uint64{lp.leaseID, lp2.leaseID} {
		if err := r.ss.release(id); err != nil {
			t.Fatal(err)
		}
	}
	wantErr(t, r.ss.release(lp.leaseID), ErrNotFound)
	if l := r.ss.list(""); len(l) != 1 || l[0].Name != "x" || l[0].Leases != 0 {
		t.Fatalf("list %+v", l)
	}
}

func TestGetWaitsForSeal(t *testing.T) {
	s := newTestStore(t, Config{})
	w, r := connect(t, s, 1000), connect(t, s, 1000)
	type result struct {
		p   placement
		err error
	}
	done := make(chan result)
	go func() {
		p, err := r.ss.getName(context.Background(), "later", true)
		done <- result{p, err}
	}()
	// The get waits for the name to exist, then to be sealed.
	data := w.put("later", 5000, false)
	res := <-done
	if res.err != nil {
		t.Fatal(res.err)
	}
	if !bytes.Equal(r.mapping(res.p), data) {
		t.Fatal("waiting get sees other bytes")
	}

	ctx, cancel := context.WithTimeout(context.Background(), time.Millisecond)
	defer cancel()
	_, err := r.ss.getName(ctx, "never", true)
	wantErr(t, err, ErrTimeout)
	// A get cut short by the end of its connection returns too.
	go func() {
		_, err := r.ss.getName(context.Background(), "never", true)
		done <- result{err: err}
	}()
	r.ss.close(errSessionClosed)
	if res := <-done; res.err == nil {
		t.Fatal("get on a closed session succeeded")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.waiters) != 0 {
		t.Fatalf("waiters left behind: %v", s.waiters)
	}
}

func TestDeleteWhileLeased(t *testing.T) {
	s := newTestStore(t, Config{Capacity: 64 << 10})
	w, r := connect(t, s, 1000), connect(t, s, 1000)
	w.put("keep", 1024, false) // keeps the arena alive throughout
	data := w.put("x", 8192, false)
	lp, view := r.get("x")

	if err := w.ss.delete("x"); err != nil {
		t.Fatal(err)
	}
	_, err := r.ss.stat("x")
	wantErr(t, err, ErrNotFound)
	_, err = r.ss.getName(context.Background(), "x", false)
	wantErr(t, err, ErrTimeout)
	// The name is free at once, but the memory is not reused while leased.
	p2, err := w.ss.createObject("x", 8192, "", false)
	if err != nil {
		t.Fatal(err)
	}
	copy(w.mapping(p2), randomBytes(8192))
	if p2.arenaID == lp.arenaID && p2.offset == lp.offset {
		t.Fatal("a leased object's memory was reused")
	}
	if !bytes.Equal(view, data) {
		t.Fatal("deleted but leased object's bytes changed")
	}
	if err := w.ss.abortName("x"); err != nil {
		t.Fatal(err)
	}

	if err := r.ss.release(lp.leaseID); err != nil {
		t.Fatal(err)
	}
	// Now the memory is free: an object of the same pool and size takes
	// the same place.
	p3, err := w.ss.createObject("z", 8192, "", false)
	if err != nil {
		t.Fatal(err)
	}
	if p3.arenaID != lp.arenaID || p3.offset != lp.offset {
		t.Fatalf("after the last release, z at arena %d offset %d, want %d/%d", p3.arenaID, p3.offset, lp.arenaID, lp.offset)
	}
}

func TestDisconnectAbortsAndReleases(t *testing.T) {
	s := newTestStore(t, Config{Capacity: 64 << 10, NoEvict: true})
	w, r := connect(t, s, 1000), connect(t, s, 1000)
	w.put("sealed", 4096, false)
	if _, err := w.ss.createObject("half", 60<<10, "", false); err != nil {
		t.Fatal(err)
	}
	lp, _ := r.get("sealed")
	if err := w.ss.delete("sealed"); err != nil {
		t.Fatal(err)
	}

	w.ss.close(errSessionClosed) // as if the creator were killed mid-write
	_, err := r.ss.stat("half")
	wantErr(t, err, ErrNotFound)
	if _, ok := s.names["half"]; ok {
		t.Fatal("unsealed object of a closed session survives")
	}

	r.ss.close(errSessionClosed) // as if the reader were killed
	st := s.devices["host"].alloc.Stats()
	if st.Blocks != 0 || st.Used != 0 || s.leases != 0 {
		t.Fatalf("after both disconnects: %+v, %d leases", st, s.leases)
	}
	wantErr(t, r.ss.release(lp.leaseID), errSessionClosed)

	// The space is usable again, in full.
	c := connect(t, s, 1000)
	c.put("all", 64<<10, false)
}

func TestReaderMappingIsReadOnly(t *testing.T) {
	s := newTestStore(t, Config{})
	w, r := connect(t, s, 1000), connect(t, s, 1000)
	w.put("x", 4096, false)
	p, err := r.ss.getName(context.Background(), "x", false)
	if err != nil {
		t.Fatal(err)
	}
	defer p.closeShare()
	fd := int(p.share.file.Fd())
	if m, err := unix.Mmap(fd, 0, int(p.arenaSize), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED); err == nil {
		unix.Munmap(m)
		t.Fatal("a reader mapped its arena writable")
	} else if !errors.Is(err, unix.EACCES) {
		t.Fatalf("mmap PROT_WRITE: %v, want EACCES", err)
	}
	if _, err := unix.Write(fd, []byte("x")); err == nil {
		t.Fatal("a reader wrote to its arena fd")
	}
	if err := unix.Ftruncate(fd, 0); err == nil {
		t.Fatal("a reader truncated its arena fd")
	}
	// Even the writer cannot resize an arena under its readers.
	wp, err := w.ss.createObject("y", 100, "", true) // a new pool, so a new arena and fd
	if err != nil {
		t.Fatal(err)
	}
	defer wp.closeShare()
	if wp.share == nil {
		t.Fatal("writer got no fd for a new arena")
	}
	if err := unix.Ftruncate(int(wp.share.file.Fd()), 0); err == nil {
		t.Fatal("the writer could shrink an arena")
	}
	if os.Geteuid() == 0 {
		t.Log("running as root: reopening through /proc is checked by TestReopenAsOtherUID")
	}
}

func TestPrivacy(t *testing.T) {
	s := newTestStore(t, Config{})
	alice, bob, root := connect(t, s, 1000), connect(t, s, 1001), connect(t, s, 0)
	secret := alice.put("secret", 300, false)
	pub := alice.put("public", 300, true)
	bob.put("bobs", 300, false)

	if l := bob.ss.list(""); !slices.Equal(names(l), []string{"bobs", "public"}) {
		t.Fatalf("bob lists %v", names(l))
	}
	_, err := bob.ss.stat("secret")
	wantErr(t, err, ErrNotFound)
	_, err = bob.ss.getName(context.Background(), "secret", false)
	wantErr(t, err, ErrTimeout)
	ctx, cancel := context.WithTimeout(context.Background(), time.Millisecond)
	_, err = bob.ss.getName(ctx, "secret", true)
	cancel()
	wantErr(t, err, ErrTimeout)
	wantErr(t, bob.ss.delete("secret"), ErrNotFound)
	wantErr(t, bob.ss.delete("public"), ErrPermission)

	pp, got := bob.get("public")
	if !bytes.Equal(got, pub) {
		t.Fatal("bob reads other bytes of the shared object")
	}
	// Bob's mapping of the shared arena must not expose alice's private
	// object: they live in different arenas.
	sp, _ := alice.get("secret")
	if sp.arenaID == pp.arenaID {
		t.Fatal("a private and a shared object share an arena")
	}
	bp, _ := bob.get("bobs")
	if bp.arenaID == pp.arenaID || bp.arenaID == sp.arenaID {
		t.Fatal("objects of different owners share an arena")
	}
	if bytes.Contains(bob.maps[sentKey{pp.arenaID, false}], secret) {
		t.Fatal("bob's mapping holds alice's private bytes")
	}

	// Root reads and deletes anything.
	if _, got := root.get("secret"); !bytes.Equal(got, secret) {
		t.Fatal("root reads other bytes")
	}
	if err := root.ss.delete("bobs"); err != nil {
		t.Fatal(err)
	}
}

func names(infos []info) []string {
	var ns []string
	for _, in := range infos {
		ns = append(ns, in.Name)
	}
	return ns
}

func TestEvictionLRU(t *testing.T) {
	// One 64 KiB arena: 16 objects of 4 KiB.
	s := newTestStore(t, Config{Capacity: 64 << 10})
	c := connect(t, s, 1000)
	ev, err := c.ss.subscribe()
	if err != nil {
		t.Fatal(err)
	}
	for i := range 16 {
		c.put(string(rune('a'+i)), 4096, false)
	}
	// a is leased (not evictable); b was used after c: c is evicted first.
	c.get("a")
	lb, _ := c.get("b")
	if err := c.ss.release(lb.leaseID); err != nil {
		t.Fatal(err)
	}
	c.put("q", 4096, false)
	c.put("r", 8192, false) // needs two adjacent blocks: d and e
	var evicted []string
	for len(ev) > 0 {
		if e := <-ev; e.kind == eventEvicted {
			evicted = append(evicted, e.name)
		}
	}
	if !slices.Equal(evicted, []string{"c", "d", "e"}) {
		t.Fatalf("evicted %v, want [c d e]", evicted)
	}
	_, err = c.ss.stat("c")
	wantErr(t, err, ErrNotFound)
	if got := s.metrics.evictions.WithLabelValues("host"); got == nil {
		t.Fatal("no eviction counter")
	}

	// Too big even with everything evicted: nothing is evicted.
	before := len(s.names)
	_, err = c.ss.createObject("huge", 128<<10, "", false)
	wantErr(t, err, ErrStoreFull)
	if len(s.names) != before {
		t.Fatal("a hopeless create evicted objects")
	}
}

func TestNoEvictStoreFull(t *testing.T) {
	s := newTestStore(t, Config{Capacity: 16 << 10, NoEvict: true})
	c := connect(t, s, 1000)
	for i := range 4 {
		c.put(string(rune('a'+i)), 4096, false)
	}
	_, err := c.ss.createObject("e", 1, "", false)
	wantErr(t, err, ErrStoreFull)
	if len(s.names) != 4 {
		t.Fatal("NoEvict store evicted")
	}
	if err := c.ss.delete("a"); err != nil {
		t.Fatal(err)
	}
	c.put("e", 4096, false)
}

func TestLimits(t *testing.T) {
	s := newTestStore(t, Config{MaxObjectsPerClient: 2, MaxLeasesPerClient: 2})
	c := connect(t, s, 1000)
	c.put("a", 10, false)
	c.put("b", 10, false)
	_, err := c.ss.createObject("c", 10, "", false)
	wantErr(t, err, ErrLimit)
	// Another connection has its own budget.
	connect(t, s, 1000).put("c", 10, false)
	// Deleting frees the budget.
	if err := c.ss.delete("a"); err != nil {
		t.Fatal(err)
	}
	c.put("d", 10, false)

	c.get("b")
	c.get("c")
	_, err = c.ss.getName(context.Background(), "d", false)
	wantErr(t, err, ErrLimit)
}

func TestInvalidArguments(t *testing.T) {
	if _, err := New(Config{Backend: "tpu"}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("unknown backend: %v", err)
	}
	s := newTestStore(t, Config{})
	c := connect(t, s, 1000)
	for _, tc := range []struct {
		name, dev string
		size      int64
	}{
		{"", "", 1}, {"a\x00b", "", 1}, {strings.Repeat("n", 256), "", 1}, {"ok", "", 0}, {"ok", "", -1}, {"ok", "cuda:0", 1},
	} {
		_, err := c.ss.createObject(tc.name, tc.size, tc.dev, false)
		wantErr(t, err, ErrInvalid)
	}
}

func TestEvents(t *testing.T) {
	s := newTestStore(t, Config{})
	alice, bob := connect(t, s, 1000), connect(t, s, 1001)
	aev, _ := alice.ss.subscribe()
	bev, _ := bob.ss.subscribe()
	alice.put("private", 10, false)
	alice.put("shared", 10, true)
	if _, err := alice.ss.createObject("gone", 10, "", true); err != nil {
		t.Fatal(err)
	}
	if err := alice.ss.abortName("gone"); err != nil {
		t.Fatal(err)
	}
	if err := alice.ss.delete("shared"); err != nil {
		t.Fatal(err)
	}
	drain := func(ch <-chan event) []string {
		var out []string
		for len(ch) > 0 {
			e := <-ch
			out = append(out, protocol.EventName(e.kind)+":"+e.name)
		}
		return out
	}
	if got, want := drain(aev), []string{"sealed:private", "sealed:shared", "aborted:gone", "deleted:shared"}; !slices.Equal(got, want) {
		t.Fatalf("alice's events %v, want %v", got, want)
	}
	// A draft is in its owner's list only: bob hears nothing of "gone".
	if got, want := drain(bev), []string{"sealed:shared", "deleted:shared"}; !slices.Equal(got, want) {
		t.Fatalf("bob's events %v, want %v", got, want)
	}
}

// TestConcurrentSessions runs many sessions creating, reading, deleting
// and disconnecting at once; run it with -race.
func TestConcurrentSessions(t *testing.T) {
	s := newTestStore(t, Config{Capacity: 4 << 20})
	var wg sync.WaitGroup
	for i := range 32 {
		wg.Go(func() {
			c := connect(t, s, uint32(1000+i%3))
			for j := range 50 {
				name := string(rune('A'+i)) + string(rune('a'+j%26))
				size := int64(1 + (i*j)%20000)
				p, err := c.ss.createObject(name, size, "", i%2 == 0)
				if errors.Is(err, ErrExists) || errors.Is(err, ErrStoreFull) {
					continue
				}
				if err != nil {
					t.Error(err)
					return
				}
				data := randomBytes(size)
				copy(c.mapping(p), data)
				if err := c.ss.sealName(name); err != nil {
					t.Error(err)
					return
				}
				lp, err := c.ss.getName(context.Background(), name, false)
				if errors.Is(err, ErrTimeout) {
					continue // evicted by another session already
				}
				if err != nil {
					t.Error(err)
					return
				}
				if !bytes.Equal(c.mapping(lp), data) {
					t.Errorf("%s: bytes differ", name)
				}
				if j%3 == 0 {
					c.ss.delete(name)
				}
				if j%5 != 0 {
					c.ss.release(lp.leaseID)
				}
			}
			c.ss.close(errSessionClosed)
		})
	}
	wg.Wait()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.leases != 0 {
		t.Fatalf("%d leases left after every session closed", s.leases)
	}
	for _, d := range s.devices {
		if d.deleted != 0 {
			t.Fatalf("%d deleted objects still held", d.deleted)
		}
	}
}

// createObject, sealName, abortName and getName are the lifecycle's plain
// forms (a plain object, no version), for tests.
func (ss *session) createObject(name string, size int64, dev string, shared bool) (placement, error) {
	p, _, err := ss.create(createReq{name: name, size: size, device: dev, shared: shared})
	return p, err
}

func (ss *session) sealName(name string) error { return ss.seal(sealReq{name: name}) }

func (ss *session) abortName(name string) error { return ss.abort(name, 0, 0) }

func (ss *session) getName(ctx context.Context, name string, wait bool) (placement, error) {
	return ss.get(ctx, name, versionSel{}, wait)
}

// TestHostBackendRefusesGPUDevices: a create on a GPU asks a host-only
// daemon for what it does not have; the INVALID answer says that the
// daemon has no GPU backend and how to start one that has.
func TestHostBackendRefusesGPUDevices(t *testing.T) {
	s := newTestStore(t, Config{})
	c := connect(t, s, 0)
	_, err := c.ss.createObject("x", 100, "GPU-5f1c2a3b-4d5e-6f70-8192-a3b4c5d6e7f8", false)
	if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "no GPU backend") || !strings.Contains(err.Error(), "--backend auto") {
		t.Fatalf("create on a GPU of a host daemon: %v", err)
	}
}
