package store

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	"github.com/cudaipc/cudaipc/internal/testutil"
	"github.com/cudaipc/cudaipc/protocol"
	"github.com/cudaipc/cudaipc/protocol/storev1"
)

// shortTempDir returns a directory whose path leaves room for a socket
// name within sun_path's 108 bytes (t.TempDir's may not).
func shortTempDir(t testing.TB) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "cis")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// serve runs a store on a socket in a fresh directory until the test ends.
func serve(t testing.TB, cfg Config) (s *Store, path string, stop func()) {
	t.Helper()
	return serveStore(t, newTestStore(t, cfg))
}

// serveGPU is serve with the cuda backend over the fake GPU testGPU
// (cuda_test.go): registrations of its memory are accepted.
func serveGPU(t testing.TB, cfg Config) (s *Store, path string, stop func()) {
	t.Helper()
	s = newTestStore(t, cfg)
	s.backend, _ = fakeCUDABackend(t)
	return serveStore(t, s)
}

// serveStore serves s on a socket in a fresh directory until the test ends.
func serveStore(t testing.TB, s *Store) (_ *Store, path string, stop func()) {
	t.Helper()
	path = filepath.Join(shortTempDir(t), "store.sock")
	l, cleanup, err := s.listen(path)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		err := s.Serve(ctx, l)
		cleanup() // before reporting, so that the socket is gone once stop returns
		done <- err
	}()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("Serve: %v", err)
			}
		})
	}
	t.Cleanup(stop)
	return s, path, stop
}

// rawClient speaks the protocol directly, as a C or Python client would.
type rawClient struct {
	t      testing.TB
	c      *protocol.Conn
	uc     *net.UnixConn // the same socket, to send what Conn refuses to
	id     uint64
	events []*storev1.Event
	maps   map[sentKey][]byte
}

func dialRaw(t testing.TB, path string) *rawClient {
	t.Helper()
	return dialRawTo(t, path, true)
}

// dialRawTo is dialRaw; inProcess says the daemon runs in this process
// (the hello must name its pid).
func dialRawTo(t testing.TB, path string, inProcess bool) *rawClient {
	t.Helper()
	uc, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	c := protocol.NewConn(uc)
	h, err := protocol.ClientHello(context.Background(), c, "store-test")
	if err != nil {
		t.Fatal(err)
	}
	if (h.GetBackend() != "host" && h.GetBackend() != "cuda") || (inProcess && h.GetPid() != uint32(os.Getpid())) || h.GetVersion() != protocol.Version {
		t.Fatalf("hello %v", h)
	}
	rc := &rawClient{t: t, c: c, uc: uc, id: 1, maps: make(map[sentKey][]byte)}
	t.Cleanup(func() {
		c.Close()
		for _, m := range rc.maps {
			unix.Munmap(m)
		}
	})
	return rc
}

// do sends a request and returns its response, keeping events that arrive
// meanwhile.
func (rc *rawClient) do(req *storev1.Request) (*storev1.Response, []*os.File) {
	rc.t.Helper()
	rc.id++
	req.Id = rc.id
	if err := rc.c.Send(req); err != nil {
		rc.t.Fatal(err)
	}
	return rc.recv(rc.id)
}

// recv returns the response to request id; with id 0, the next event.
// A daemon that does not answer within testutil.Wait fails the test.
func (rc *rawClient) recv(id uint64) (*storev1.Response, []*os.File) {
	rc.t.Helper()
	for {
		var resp storev1.Response
		rc.c.SetReadDeadline(time.Now().Add(testutil.Wait))
		files, err := rc.c.Recv(&resp)
		rc.c.SetReadDeadline(time.Time{})
		if err != nil {
			rc.t.Fatal(err)
		}
		if err := protocol.ValidateResponse(&resp, len(files)); err != nil {
			rc.t.Fatal(err)
		}
		if resp.GetId() == 0 {
			rc.events = append(rc.events, resp.GetEvent())
			if id == 0 {
				return &resp, files
			}
			continue
		}
		if resp.GetId() != id {
			rc.t.Fatalf("response to %d while waiting for %d", resp.GetId(), id)
		}
		return &resp, files
	}
}

// mapping maps a placement's arena if it came with a file, and returns the
// object's bytes.
func (rc *rawClient) mapping(p *storev1.Placement, files []*os.File) []byte {
	rc.t.Helper()
	k := sentKey{p.GetArenaId(), p.GetWritable()}
	if p.GetFdAttached() {
		prot := unix.PROT_READ
		if p.GetWritable() {
			prot |= unix.PROT_WRITE
		}
		m, err := unix.Mmap(int(files[0].Fd()), 0, int(p.GetArenaSize()), prot, unix.MAP_SHARED)
		protocol.CloseFiles(files)
		if err != nil {
			rc.t.Fatal(err)
		}
		rc.maps[k] = m
	}
	m, ok := rc.maps[k]
	if !ok {
		rc.t.Fatalf("placement in arena %d, never sent", p.GetArenaId())
	}
	return m[p.GetOffset() : p.GetOffset()+p.GetSize()]
}

// req wraps body in a request; rawClient.do gives it its id.
func req(body proto.Message) *storev1.Request { return testutil.Request(body) }

func code(resp *storev1.Response) storev1.Error_Code { return resp.GetError().GetCode() }

func wantCode(t testing.TB, resp *storev1.Response, want storev1.Error_Code) {
	t.Helper()
	if got := code(resp); got != want {
		t.Fatalf("code %v (%s), want %v", got, resp.GetError().GetMessage(), want)
	}
}

func (rc *rawClient) put(name string, size int, shared bool) []byte {
	rc.t.Helper()
	resp, files := rc.do(req(&storev1.CreateRequest{Name: name, Size: uint64(size), Shared: shared}))
	wantCode(rc.t, resp, storev1.Error_OK)
	data := randomBytes(int64(size))
	copy(rc.mapping(resp.GetCreate().GetPlacement(), files), data)
	resp, _ = rc.do(req(&storev1.SealRequest{Name: name}))
	wantCode(rc.t, resp, storev1.Error_OK)
	return data
}

func TestServerRoundTrip(t *testing.T) {
	s, path, _ := serve(t, Config{})
	w, r := dialRaw(t, path), dialRaw(t, path)

	resp, files := w.do(req(&storev1.CreateRequest{Name: "x", Size: 200_000, Device: "host"}))
	wantCode(t, resp, storev1.Error_OK)
	cp := resp.GetCreate().GetPlacement()
	if !cp.GetFdAttached() || len(files) != 1 || !cp.GetWritable() || cp.GetDevice() != "host" || cp.GetOffset()%256 != 0 {
		t.Fatalf("create placement %v with %d files", cp, len(files))
	}
	data := randomBytes(200_000)
	copy(w.mapping(cp, files), data)

	resp, _ = r.do(req(&storev1.GetRequest{Name: "x"}))
	wantCode(t, resp, storev1.Error_TIMEOUT)
	resp, _ = r.do(req(&storev1.StatRequest{Name: "x"}))
	wantCode(t, resp, storev1.Error_NOT_FOUND)
	resp, _ = w.do(req(&storev1.SealRequest{Name: "x"}))
	wantCode(t, resp, storev1.Error_OK)

	resp, files = r.do(req(&storev1.GetRequest{Name: "x"}))
	wantCode(t, resp, storev1.Error_OK)
	g := resp.GetGet()
	if g.GetPlacement().GetWritable() || !g.GetPlacement().GetFdAttached() || g.GetInfo().GetLeases() != 1 || g.GetInfo().GetOwnerUid() != uint32(os.Geteuid()) {
		t.Fatalf("get %v", g)
	}
	if !bytes.Equal(r.mapping(g.GetPlacement(), files), data) {
		t.Fatal("reader sees other bytes")
	}
	// The same arena again: no descriptor.
	resp, files = r.do(req(&storev1.GetRequest{Name: "x", TimeoutMs: -1}))
	wantCode(t, resp, storev1.Error_OK)
	if resp.GetGet().GetPlacement().GetFdAttached() || len(files) != 0 {
		t.Fatal("arena sent twice")
	}
	lease2 := resp.GetGet().GetLeaseId()

	resp, _ = r.do(req(&storev1.ListRequest{}))
	if l := resp.GetList().GetObjects(); len(l) != 1 || l[0].GetName() != "x" || l[0].GetLeases() != 2 || !l[0].GetSealed() {
		t.Fatalf("list %v", resp)
	}
	resp, _ = r.do(req(&storev1.ReleaseRequest{LeaseId: lease2}))
	wantCode(t, resp, storev1.Error_OK)
	resp, _ = r.do(req(&storev1.ReleaseRequest{LeaseId: lease2}))
	wantCode(t, resp, storev1.Error_NOT_FOUND)
	resp, _ = w.do(req(&storev1.DeleteRequest{Name: "x"}))
	wantCode(t, resp, storev1.Error_OK)
	resp, _ = r.do(req(&storev1.StatRequest{Name: "x"}))
	wantCode(t, resp, storev1.Error_NOT_FOUND)
	resp, _ = w.do(req(&storev1.HelloRequest{Version: 1}))
	wantCode(t, resp, storev1.Error_INVALID)
	resp, _ = w.do(req(&storev1.CreateRequest{Name: "bad\tname", Size: 1}))
	wantCode(t, resp, storev1.Error_INVALID)

	// Metrics reflect what happened.
	rec := httptest.NewRecorder()
	s.MetricsHandler().ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	body := rec.Body.String()
	for _, want := range []string{
		`cudaipc_store_requests_total{op="create",result="ok"} 1`,
		`cudaipc_store_requests_total{op="get",result="timeout"} 1`,
		`cudaipc_store_requests_total{op="create",result="invalid"} 1`,
		`cudaipc_store_objects{device="host",state="deleted"} 1`,
		`cudaipc_store_leases 1`,
		`cudaipc_store_clients 2`,
		`cudaipc_store_bytes_capacity{device="host"} 1.073741824e+09`,
	} {
		if !strings.Contains(body, want) {
			t.Errorf("metrics lack %s", want)
		}
	}
	if t.Failed() {
		t.Log(body)
	}
}

func TestServerGetWaitsWithoutBlockingTheConnection(t *testing.T) {
	_, path, _ := serve(t, Config{})
	w, r := dialRaw(t, path), dialRaw(t, path)
	// A get without limit, then a stat on the same connection: the stat is
	// answered while the get waits.
	if err := r.c.Send(&storev1.Request{Id: 100, Body: &storev1.Request_Get{Get: &storev1.GetRequest{Name: "later", TimeoutMs: -1}}}); err != nil {
		t.Fatal(err)
	}
	resp, _ := r.do(req(&storev1.StatRequest{Name: "later"}))
	wantCode(t, resp, storev1.Error_NOT_FOUND)
	data := w.put("later", 3000, false)
	resp, files := r.recv(100)
	wantCode(t, resp, storev1.Error_OK)
	if !bytes.Equal(r.mapping(resp.GetGet().GetPlacement(), files), data) {
		t.Fatal("waiting get sees other bytes")
	}
	resp, _ = r.do(req(&storev1.GetRequest{Name: "never", TimeoutMs: 1}))
	wantCode(t, resp, storev1.Error_TIMEOUT)
}

func TestServerDisconnectAbortsAndReleases(t *testing.T) {
	s, path, _ := serve(t, Config{})
	watcher, w, r := dialRaw(t, path), dialRaw(t, path), dialRaw(t, path)
	resp, _ := watcher.do(req(&storev1.SubscribeRequest{}))
	wantCode(t, resp, storev1.Error_OK)

	w.put("kept", 1000, false)
	resp, _ = w.do(req(&storev1.CreateRequest{Name: "half", Size: 1000}))
	wantCode(t, resp, storev1.Error_OK)
	resp, _ = r.do(req(&storev1.GetRequest{Name: "kept"}))
	wantCode(t, resp, storev1.Error_OK)
	resp, _ = w.do(req(&storev1.DeleteRequest{Name: "kept"}))
	wantCode(t, resp, storev1.Error_OK)

	w.c.Close() // the creator goes away mid-write
	r.c.Close() // the reader goes away holding its lease
	// The watcher learns of the abort from its events.
	testutil.Eventually(t, testutil.Wait, func() error {
		if hasEvent(watcher.events, storev1.Event_ABORTED, "half") {
			return nil
		}
		watcher.recv(0)
		return fmt.Errorf("no ABORTED event for half in %v", watcher.events)
	})
	if !hasEvent(watcher.events, storev1.Event_SEALED, "kept") || !hasEvent(watcher.events, storev1.Event_DELETED, "kept") {
		t.Fatalf("events %v", watcher.events)
	}
	resp, _ = watcher.do(req(&storev1.StatRequest{Name: "half"}))
	wantCode(t, resp, storev1.Error_NOT_FOUND)
	// The lease goes when the reader's connection is cleaned up; a new
	// object of the same size shows the memory free again.
	testutil.Eventually(t, testutil.Wait, func() error {
		s.mu.Lock()
		n := s.leases
		s.mu.Unlock()
		if n != 0 {
			return fmt.Errorf("%d leases after the reader left", n)
		}
		return nil
	})
}

func hasEvent(events []*storev1.Event, kind storev1.Event_Kind, name string) bool {
	for _, e := range events {
		if e.GetKind() == kind && e.GetName() == name {
			return true
		}
	}
	return false
}

func TestServerBadPacketsCloseOnlyThatConnection(t *testing.T) {
	_, path, _ := serve(t, Config{})
	good := dialRaw(t, path)
	good.put("x", 100, false)

	for name, packet := range map[string][]byte{
		"garbage":   {0xff, 0xff, 0xff, 0xff, 0x0f},
		"oversized": bytes.Repeat([]byte{0x0a}, protocol.MaxMessageSize+100),
	} {
		t.Run(name, func(t *testing.T) {
			bad := dialRaw(t, path)
			if _, err := bad.uc.Write(packet); err != nil {
				t.Fatal(err)
			}
			var resp storev1.Response
			if _, err := bad.c.Recv(&resp); !errors.Is(err, io.EOF) {
				t.Fatalf("after a bad packet: %v, %v; want the connection closed", &resp, err)
			}
		})
	}
	t.Run("fd on a request", func(t *testing.T) {
		bad := dialRaw(t, path)
		f, err := os.Open(os.DevNull)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		if err := bad.c.Send(&storev1.Request{Id: 5, Body: &storev1.Request_List{List: &storev1.ListRequest{}}}, f); err != nil {
			t.Fatal(err)
		}
		resp, _ := bad.recv(5)
		wantCode(t, resp, storev1.Error_INVALID)
		var r2 storev1.Response
		if _, err := bad.c.Recv(&r2); !errors.Is(err, io.EOF) {
			t.Fatalf("connection not closed: %v", err)
		}
	})
	t.Run("unknown operation", func(t *testing.T) {
		c := dialRaw(t, path)
		// id 7 and field 50, an operation of some later version, empty.
		if _, err := c.uc.Write([]byte{0x08, 0x07, 0x92, 0x03, 0x00}); err != nil {
			t.Fatal(err)
		}
		resp, _ := c.recv(7)
		wantCode(t, resp, storev1.Error_INVALID)
		// The connection stays usable.
		resp, _ = c.do(req(&storev1.StatRequest{Name: "x"}))
		wantCode(t, resp, storev1.Error_OK)
	})
	resp, files := good.do(req(&storev1.GetRequest{Name: "x"}))
	wantCode(t, resp, storev1.Error_OK)
	protocol.CloseFiles(files)
}

func TestServerVersionMismatch(t *testing.T) {
	_, path, _ := serve(t, Config{})
	c, err := protocol.Dial(context.Background(), path)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if err := c.Send(req(&storev1.HelloRequest{Version: 99})); err != nil {
		t.Fatal(err)
	}
	// Id 0 is invalid, so the hello is refused for that first.
	var resp storev1.Response
	if _, err := c.Recv(&resp); err != nil {
		t.Fatal(err)
	}
	wantCode(t, &resp, storev1.Error_INVALID)

	c2, err := protocol.Dial(context.Background(), path)
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	hello := req(&storev1.HelloRequest{Version: 99})
	hello.Id = 1
	if err := c2.Send(hello); err != nil {
		t.Fatal(err)
	}
	resp.Reset()
	if _, err := c2.Recv(&resp); err != nil {
		t.Fatal(err)
	}
	wantCode(t, &resp, storev1.Error_VERSION)
	if _, err := c2.Recv(&resp); !errors.Is(err, io.EOF) {
		t.Fatalf("connection left open after a version mismatch: %v", err)
	}
}

func TestServerShutdown(t *testing.T) {
	s, path, stop := serve(t, Config{})
	c := dialRaw(t, path)
	c.put("x", 10, false)
	resp, _ := c.do(req(&storev1.CreateRequest{Name: "half", Size: 10}))
	wantCode(t, resp, storev1.Error_OK)
	if err := c.c.Send(&storev1.Request{Id: 77, Body: &storev1.Request_Get{Get: &storev1.GetRequest{Name: "never", TimeoutMs: -1}}}); err != nil {
		t.Fatal(err)
	}
	// A client that never says hello does not hold up the shutdown.
	silent, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	defer silent.Close()
	stop()
	var r storev1.Response
	if _, err := c.c.Recv(&r); !errors.Is(err, io.EOF) {
		t.Fatalf("after shutdown: %v %v", &r, err)
	}
	if _, err := os.Lstat(path); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("socket left behind: %v", err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.sessions) != 0 || s.names[protocol.QualifiedName(uint32(os.Geteuid()), "half")].exists() || !s.names[protocol.QualifiedName(uint32(os.Geteuid()), "x")].exists() {
		t.Fatalf("after shutdown: %d sessions, names %v", len(s.sessions), s.names)
	}
}

// TestServerConcurrentClients runs 64 clients at once over real sockets;
// run it with -race.
func TestServerConcurrentClients(t *testing.T) {
	s, path, _ := serve(t, Config{Capacity: 256 << 20})
	var wg sync.WaitGroup
	for i := range 64 {
		wg.Go(func() {
			c := dialRaw(t, path)
			for j := range 20 {
				name := "c" + string(rune('A'+i%26)) + string(rune('a'+i/26)) + string(rune('a'+j))
				data := c.put(name, 1+(i*7919+j*104729)%100_000, i%2 == 0)
				resp, files := c.do(req(&storev1.GetRequest{Name: name, TimeoutMs: -1}))
				if code(resp) != storev1.Error_OK {
					t.Errorf("get %s: %v", name, resp.GetError())
					return
				}
				if !bytes.Equal(c.mapping(resp.GetGet().GetPlacement(), files), data) {
					t.Errorf("%s: bytes differ", name)
				}
				if j%2 == 0 {
					c.do(req(&storev1.ReleaseRequest{LeaseId: resp.GetGet().GetLeaseId()}))
				}
				c.do(req(&storev1.DeleteRequest{Name: name}))
			}
			c.c.Close()
		})
	}
	wg.Wait()
	// Every connection is gone or going; once all sessions are cleaned
	// up, no memory is held.
	testutil.Eventually(t, testutil.Wait, func() error {
		s.mu.Lock()
		n, leases, used := len(s.sessions), s.leases, s.devices["host"].alloc.Stats().Used
		s.mu.Unlock()
		if n != 0 {
			return fmt.Errorf("%d sessions after all clients left", n)
		}
		if leases != 0 || used != 0 {
			t.Fatalf("after all clients left: %d leases, %d bytes used", leases, used)
		}
		return nil
	})
}

// TestServerSlowSubscriber checks that a subscriber that does not read
// misses events instead of making the daemon queue them without bound or
// block, and that its connection still works.
func TestServerSlowSubscriber(t *testing.T) {
	s, path, _ := serve(t, Config{})
	sub := dialRaw(t, path)
	resp, _ := sub.do(req(&storev1.SubscribeRequest{}))
	wantCode(t, resp, storev1.Error_OK)
	sub.put("mine", 10, false)
	resp, _ = sub.do(req(&storev1.GetRequest{Name: "mine"}))
	wantCode(t, resp, storev1.Error_OK)
	producer := connect(t, s, uint32(os.Geteuid()))
	for i := 0; testutilCounter(s.metrics.eventsDropped) == 0; i++ {
		if i > 1_000_000 {
			t.Fatal("no event ever dropped")
		}
		producer.put("e", 1, false)
		if err := producer.ss.delete("e"); err != nil {
			t.Fatal(err)
		}
	}
	// Still connected, lease intact.
	resp, _ = sub.do(req(&storev1.StatRequest{Name: "mine"}))
	wantCode(t, resp, storev1.Error_OK)
	if resp.GetStat().GetInfo().GetLeases() != 1 {
		t.Fatalf("lease lost: %v", resp.GetStat().GetInfo())
	}
}

func testutilCounter(c prometheus.Counter) float64 {
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		panic(err)
	}
	return m.GetCounter().GetValue()
}
