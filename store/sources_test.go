package store

import (
	"bytes"
	"crypto/rand"
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/bundle"
	"github.com/cudaipc/cudaipc/internal/testutil"
	"github.com/cudaipc/cudaipc/protocol"
	"github.com/cudaipc/cudaipc/protocol/storev1"
)

// ipcRegion is a binary cuda-ipc region of a whole allocation of size
// bytes: the daemon never opens it, so a random handle does.
func ipcRegion(t *testing.T, size int64, device string) []byte {
	t.Helper()
	u, err := cudaipc.ParseUUID(device)
	if err != nil {
		t.Fatal(err)
	}
	r := cudaipc.Region{Version: cudaipc.RegionVersion, Kind: cudaipc.KindCUDAIPC, Size: size, AllocSize: size,
		Device: u, ExporterPID: 42, PIDNamespace: 4026531836, BootID: cudaipc.BootID{1}, BufferID: 7, ExporterBase: 0x7f0000000000}
	rand.Read(r.Handle[:])
	b, err := r.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// noCopy is a no-copy version as a publisher sends it: its manifest (one
// tensor in each region) and sources table, and the span they make.
type noCopy struct {
	header, table []byte
	size          int64
}

func newNoCopy(t *testing.T, regions ...[]byte) noCopy {
	t.Helper()
	sizes := make([]int64, len(regions))
	for i, b := range regions {
		r, err := cudaipc.DecodeRegion(b)
		if err != nil {
			t.Fatal(err)
		}
		sizes[i] = r.Size
	}
	starts, span, err := bundle.SourceStarts(sizes)
	if err != nil {
		t.Fatal(err)
	}
	m := &bundle.Manifest{}
	for i, at := range starts {
		m.Tensors = append(m.Tensors, bundle.Tensor{Name: string(rune('a' + i)), DType: bundle.U8, Shape: []int64{sizes[i] / 2}, Begin: at, End: at + sizes[i]/2})
	}
	return noCopy{header: m.Marshal(), table: bundle.EncodeSources(regions), size: span}
}

// publish creates, writes and seals a no-copy version of name; it returns
// the version.
func (rc *rawClient) publishNoCopy(name string, nc noCopy, keep uint32, files ...*os.File) uint64 {
	rc.t.Helper()
	resp := rc.createNoCopy(name, nc, keep, files...)
	wantCode(rc.t, resp.resp, storev1.Error_OK)
	n := resp.resp.GetCreate().GetVersion()
	s, _ := rc.do(req(&storev1.SealRequest{Name: name, Version: n}))
	wantCode(rc.t, s, storev1.Error_OK)
	return n
}

type createResult struct {
	resp  *storev1.Response
	files []*os.File
}

func (rc *rawClient) createNoCopy(name string, nc noCopy, keep uint32, files ...*os.File) createResult {
	rc.t.Helper()
	rc.id++
	r := &storev1.CreateRequest{Name: name, Size: uint64(nc.size), Device: testGPU, Shared: true, Versioned: true, KeepLast: keep,
		ManifestSize: uint64(len(nc.header)), SourcesSize: uint64(len(nc.table)), Files: uint32(len(files))}
	if err := rc.c.Send(&storev1.Request{Id: rc.id, Body: &storev1.Request_Create{Create: r}}, files...); err != nil {
		rc.t.Fatal(err)
	}
	resp, got := rc.recv(rc.id)
	if code(resp) == storev1.Error_OK {
		p := resp.GetCreate().GetPlacement()
		if !p.GetExternal() || !p.GetWritable() || p.GetFiles() != 0 || len(p.GetRegion()) != 0 || p.GetSize() != uint64(nc.size) || len(got) != 1 {
			rc.t.Fatalf("no-copy create: placement %v with %d files", p, len(got))
		}
		if _, err := got[0].WriteAt(append(append([]byte{}, nc.header...), nc.table...), 0); err != nil {
			rc.t.Fatal(err)
		}
	}
	protocol.CloseFiles(got)
	return createResult{resp, got}
}

func (rc *rawClient) withdraw(name string, timeout time.Duration) *storev1.Response {
	rc.t.Helper()
	resp, _ := rc.do(&storev1.Request{Body: &storev1.Request_Withdraw{Withdraw: &storev1.WithdrawRequest{Name: name, TimeoutMs: timeout.Milliseconds()}}})
	return resp
}

// A no-copy version goes through the one lifecycle: its reader gets the
// manifest and sources table in one memfd and the VMM descriptors beside
// it; a withdraw stops new leases at once and answers only once the last
// lease ended, failing meanwhile with the readers' count.
func TestNoCopyVersionWithdraw(t *testing.T) {
	_, path, _ := serve(t, Config{})
	pub := dialRaw(t, path)
	content := make([]byte, 32)
	rand.Read(content)
	piece := memfdPiece(t, content)
	defer piece.Close()
	nc := newNoCopy(t, ipcRegion(t, 1<<20, testGPU), vmmRegion(t, 0, 2<<20, 2<<20))
	v := pub.publishNoCopy("policy", nc, 1, piece)

	var readers []*rawClient
	var leases []uint64
	for range 2 {
		rd := dialRaw(t, path)
		g, got := rd.do(req(&storev1.GetRequest{Name: "policy", NewerThan: 0, Version: v}))
		wantCode(t, g, storev1.Error_OK)
		gg := g.GetGet()
		p, in := gg.GetPlacement(), gg.GetInfo()
		if !p.GetExternal() || p.GetFiles() != 1 || !gg.GetManifestAttached() || len(got) != 2 || in.GetSourcesSize() != uint64(len(nc.table)) ||
			in.GetManifestSize() != uint64(len(nc.header)) || !in.GetExternal() || !in.GetExporterBound() || p.GetSize() != uint64(nc.size) {
			t.Fatalf("no-copy get: placement %v info %v with %d files", p, in, len(got))
		}
		if !bytes.Equal(readAll(t, got[0]), content) {
			t.Fatal("the reader got another descriptor than the publisher sent")
		}
		all := make([]byte, len(nc.header)+len(nc.table))
		if _, err := got[1].ReadAt(all, 0); err != nil || !bytes.Equal(all, append(append([]byte{}, nc.header...), nc.table...)) {
			t.Fatalf("the manifest memfd does not hold the header and table the publisher wrote (%v)", err)
		}
		protocol.CloseFiles(got)
		readers, leases = append(readers, rd), append(leases, gg.GetLeaseId())
	}

	w := pub.withdraw("policy", 50*time.Millisecond)
	wantCode(t, w, storev1.Error_TIMEOUT)
	if msg := w.GetError().GetMessage(); !strings.Contains(msg, "2 readers still hold 2 leases") {
		t.Fatalf("withdraw timed out with %q: want the readers' count", msg)
	}
	// Withdrawn: no new lease, by version or as the latest.
	late := dialRaw(t, path)
	g, _ := late.do(req(&storev1.GetRequest{Name: "policy", Version: v}))
	wantCode(t, g, storev1.Error_NOT_FOUND)
	g, _ = late.do(req(&storev1.GetRequest{Name: "policy"}))
	wantCode(t, g, storev1.Error_TIMEOUT)

	rel, _ := readers[0].do(req(&storev1.ReleaseRequest{LeaseId: leases[0]}))
	wantCode(t, rel, storev1.Error_OK)
	w = pub.withdraw("policy", 50*time.Millisecond)
	if msg := w.GetError().GetMessage(); !strings.Contains(msg, "1 readers still hold 1 leases") {
		t.Fatalf("withdraw timed out with %q: want 1 reader", msg)
	}
	// A withdraw that waits without limit answers when the last lease ends.
	pub.id++
	id := pub.id
	if err := pub.c.Send(&storev1.Request{Id: id, Body: &storev1.Request_Withdraw{Withdraw: &storev1.WithdrawRequest{Name: "policy", TimeoutMs: -1}}}); err != nil {
		t.Fatal(err)
	}
	rel, _ = readers[1].do(req(&storev1.ReleaseRequest{LeaseId: leases[1]}))
	wantCode(t, rel, storev1.Error_OK)
	resp, _ := pub.recv(id)
	wantCode(t, resp, storev1.Error_OK)
	// The next version is readable as the latest.
	v2 := pub.publishNoCopy("policy", nc, 1, piece)
	g, got := late.do(req(&storev1.GetRequest{Name: "policy", NewerThan: v}))
	protocol.CloseFiles(got)
	wantCode(t, g, storev1.Error_OK)
	if g.GetGet().GetInfo().GetVersion() != v2 {
		t.Fatalf("got version %d, want %d", g.GetGet().GetInfo().GetVersion(), v2)
	}
	rel, _ = late.do(req(&storev1.ReleaseRequest{LeaseId: g.GetGet().GetLeaseId()}))
	wantCode(t, rel, storev1.Error_OK)
	resp = pub.withdraw("policy", time.Second)
	wantCode(t, resp, storev1.Error_OK)
	if n := resp.GetWithdraw().GetVersions(); n != 1 {
		t.Fatalf("withdrew %d versions, want 1", n)
	}
	// Nothing published without a copy under a plain name: nothing to wait for.
	wantCode(t, pub.withdraw("nothing-here", time.Second), storev1.Error_OK)
}

// A publisher that disconnects withdraws its versions with a cuda-ipc
// region at once; a version of VMM memory alone stays readable while
// leased, and its descriptors close with its last lease.
func TestNoCopyPublisherGone(t *testing.T) {
	_, path, _ := serve(t, Config{})
	pub := dialRaw(t, path)
	content := make([]byte, 32)
	rand.Read(content)
	piece := memfdPiece(t, content)
	defer piece.Close()
	pub.publishNoCopy("legacy", newNoCopy(t, ipcRegion(t, 4<<20, testGPU)), 1)
	vmm := newNoCopy(t, vmmRegion(t, 0, 2<<20, 2<<20))
	pub.publishNoCopy("vmm", vmm, 1, piece)

	rd := dialRaw(t, path)
	g, got := rd.do(req(&storev1.GetRequest{Name: "legacy"}))
	protocol.CloseFiles(got)
	wantCode(t, g, storev1.Error_OK)
	legacyLease := g.GetGet().GetLeaseId()
	g, got = rd.do(req(&storev1.GetRequest{Name: "vmm"}))
	protocol.CloseFiles(got)
	wantCode(t, g, storev1.Error_OK)
	vmmLease := g.GetGet().GetLeaseId()

	pub.c.Close()
	other := dialRaw(t, path)
	testutil.Eventually(t, testutil.Wait, func() error {
		if g, _ := other.do(req(&storev1.GetRequest{Name: "legacy"})); code(g) != storev1.Error_TIMEOUT {
			return errors.New("the legacy version is still readable after its publisher left")
		}
		return nil
	})
	// Orphaned, still leased: readable, and says so.
	g, got = other.do(req(&storev1.GetRequest{Name: "vmm"}))
	wantCode(t, g, storev1.Error_OK)
	if !g.GetGet().GetInfo().GetOrphaned() || len(got) != 2 || !bytes.Equal(readAll(t, got[0]), content) {
		t.Fatalf("orphaned vmm version: info %v, %d files", g.GetGet().GetInfo(), len(got))
	}
	protocol.CloseFiles(got)
	rel, _ := other.do(req(&storev1.ReleaseRequest{LeaseId: g.GetGet().GetLeaseId()}))
	wantCode(t, rel, storev1.Error_OK)
	for _, id := range []uint64{legacyLease, vmmLease} {
		rel, _ := rd.do(req(&storev1.ReleaseRequest{LeaseId: id}))
		wantCode(t, rel, storev1.Error_OK)
	}
	g, _ = other.do(req(&storev1.GetRequest{Name: "vmm"}))
	wantCode(t, g, storev1.Error_TIMEOUT)
}

// What a no-copy create or seal must not accept.
func TestNoCopyRefused(t *testing.T) {
	_, path, _ := serve(t, Config{})
	pub := dialRaw(t, path)
	piece := memfdPiece(t, []byte("x"))
	defer piece.Close()
	const other = "GPU-00000000-1111-2222-3333-444444444444"
	good := newNoCopy(t, ipcRegion(t, 1<<20, testGPU))
	seal := func(nc noCopy, files ...*os.File) *storev1.Response {
		r := pub.createNoCopy("bad", nc, 0, files...)
		if code(r.resp) != storev1.Error_OK {
			return r.resp
		}
		s, _ := pub.do(req(&storev1.SealRequest{Name: "bad", Version: r.resp.GetCreate().GetVersion()}))
		return s
	}
	cases := []struct {
		name  string
		nc    noCopy
		files []*os.File
		want  string
	}{
		{"span", noCopy{good.header, good.table, good.size + 256}, nil, "span"},
		{"device", newNoCopy(t, ipcRegion(t, 1<<20, other)), nil, "is on"},
		{"descriptors", newNoCopy(t, vmmRegion(t, 0, 2<<20, 2<<20)), nil, "descriptors"},
		{"extra descriptor", good, []*os.File{piece}, "descriptors"},
		{"garbage table", noCopy{good.header, []byte{3, 0, 0, 0, 1, 2, 3}, good.size}, nil, "region 0"},
		{"truncated table", noCopy{good.header, good.table[:10], good.size}, nil, "runs past"},
	}
	for _, c := range cases {
		resp := seal(c.nc, c.files...)
		wantCode(t, resp, storev1.Error_INVALID)
		if !strings.Contains(resp.GetError().GetMessage(), c.want) {
			t.Errorf("%s: %q, want it to mention %q", c.name, resp.GetError().GetMessage(), c.want)
		}
	}
	// Not a version, or no manifest: refused at create.
	pub.id++
	r := &storev1.CreateRequest{Name: "plain", Size: uint64(good.size), Device: testGPU, ManifestSize: uint64(len(good.header)), SourcesSize: uint64(len(good.table))}
	if err := pub.c.Send(&storev1.Request{Id: pub.id, Body: &storev1.Request_Create{Create: r}}); err != nil {
		t.Fatal(err)
	}
	resp, _ := pub.recv(pub.id)
	wantCode(t, resp, storev1.Error_INVALID)
	// A withdraw of a plain object is a mistake worth naming.
	c, _ := pub.do(req(&storev1.CreateRequest{Name: "plain", Size: 8}))
	wantCode(t, c, storev1.Error_OK)
	s, _ := pub.do(req(&storev1.SealRequest{Name: "plain"}))
	wantCode(t, s, storev1.Error_OK)
	wantCode(t, pub.withdraw("plain", time.Second), storev1.Error_INVALID)
}

// A no-copy version of VMM memory over more pieces than one packet carries:
// the publisher stages the descriptors beyond 60, the create takes them all,
// a reader gets the first 60 with its lease and the rest by files requests,
// each the very file the publisher sent, in table order.
func TestNoCopyManyPieces(t *testing.T) {
	_, path, _ := serve(t, Config{})
	pub := dialRaw(t, path)
	const pieces = 2*protocol.MaxFiles + 7
	sizes := make([]int64, pieces)
	var files []*os.File
	var contents [][]byte
	for i := range sizes {
		sizes[i] = 2 << 20
		c := make([]byte, 16)
		rand.Read(c)
		f := memfdPiece(t, c)
		defer f.Close()
		files, contents = append(files, f), append(contents, c)
	}
	// Two regions: 100 pieces, then the rest.
	nc := newNoCopy(t, vmmRegion(t, 0, 100*(2<<20), sizes[:100]...), vmmRegion(t, 0, int64(pieces-100)*(2<<20), sizes[100:]...))
	rest := files
	for len(rest) > protocol.MaxFiles {
		resp, _ := pub.sendFiles(stageReq(), rest[:protocol.MaxFiles]...)
		wantCode(t, resp, storev1.Error_OK)
		rest = rest[protocol.MaxFiles:]
	}
	create := &storev1.CreateRequest{Name: "big", Size: uint64(nc.size), Device: testGPU, Shared: true, Versioned: true,
		ManifestSize: uint64(len(nc.header)), SourcesSize: uint64(len(nc.table)), Files: pieces}
	resp, got := pub.sendFiles(&storev1.Request{Body: &storev1.Request_Create{Create: create}}, rest...)
	wantCode(t, resp, storev1.Error_OK)
	if len(got) != 1 {
		t.Fatalf("create answered with %d descriptors, want the manifest's", len(got))
	}
	if _, err := got[0].WriteAt(append(append([]byte{}, nc.header...), nc.table...), 0); err != nil {
		t.Fatal(err)
	}
	protocol.CloseFiles(got)
	s, _ := pub.do(req(&storev1.SealRequest{Name: "big", Version: resp.GetCreate().GetVersion()}))
	wantCode(t, s, storev1.Error_OK)

	rd := dialRaw(t, path)
	g, first := rd.do(req(&storev1.GetRequest{Name: "big"}))
	wantCode(t, g, storev1.Error_OK)
	p := g.GetGet().GetPlacement()
	// 59 pieces and the manifest's memfd: one packet's 60.
	if p.GetFiles() != pieces || len(first) != protocol.MaxFiles {
		t.Fatalf("get: files %d with %d descriptors (the manifest's last)", p.GetFiles(), len(first))
	}
	all := first[:protocol.MaxFiles-1]
	protocol.CloseFiles(first[protocol.MaxFiles-1:])
	for len(all) < pieces {
		fr, more := rd.sendFiles(filesReq(g.GetGet().GetLeaseId(), uint32(len(all))))
		wantCode(t, fr, storev1.Error_OK)
		all = append(all, more...)
	}
	for i, f := range all {
		if !bytes.Equal(readAll(t, f), contents[i]) {
			t.Fatalf("descriptor %d is not the publisher's piece %d", i, i)
		}
	}
	protocol.CloseFiles(all)
}

// likeCreate sends a republish of version like of name (no write, no seal).
func (rc *rawClient) likeCreate(name string, nc noCopy, like uint64, mutate func(*storev1.CreateRequest)) (*storev1.Response, []*os.File) {
	rc.t.Helper()
	r := &storev1.CreateRequest{Name: name, Size: uint64(nc.size), Device: testGPU, Shared: true, Versioned: true, KeepLast: 1,
		ManifestSize: uint64(len(nc.header)), SourcesSize: uint64(len(nc.table)), LikeVersion: like}
	if mutate != nil {
		mutate(r)
	}
	return rc.do(req(r))
}

// A republish (like_version) of a no-copy version over the same cuda-ipc
// regions is sealed by its create alone: readers waiting for a newer
// version get it, with the very manifest and table of the version it is
// like (the same sealed memfd), and it is withdrawn and leased like any
// version. A republish of what is not this connection's sealed no-copy
// version of cuda-ipc regions of the same sizes is refused, and nothing is
// left behind: the next version number is the next one.
func TestNoCopyRepublish(t *testing.T) {
	_, path, _ := serve(t, Config{})
	pub := dialRaw(t, path)
	nc := newNoCopy(t, ipcRegion(t, 1<<20, testGPU), ipcRegion(t, 3<<20, testGPU))
	v1 := pub.publishNoCopy("policy", nc, 1)
	wantCode(t, pub.withdraw("policy", time.Second), storev1.Error_OK)

	rd := dialRaw(t, path)
	rd.id++
	wait := rd.id
	if err := rd.c.Send(&storev1.Request{Id: wait, Body: &storev1.Request_Get{Get: &storev1.GetRequest{Name: "policy", NewerThan: v1, TimeoutMs: 10000}}}); err != nil {
		t.Fatal(err)
	}
	resp, got := pub.likeCreate("policy", nc, v1, nil)
	wantCode(t, resp, storev1.Error_OK)
	if len(got) != 0 || resp.GetCreate().GetManifestAttached() {
		t.Fatalf("a republish's reply carries %d descriptors (manifest attached %v): want none", len(got), resp.GetCreate().GetManifestAttached())
	}
	v2 := resp.GetCreate().GetVersion()
	if v2 != v1+1 {
		t.Fatalf("republished as version %d, want %d", v2, v1+1)
	}
	g, files := rd.recv(wait)
	wantCode(t, g, storev1.Error_OK)
	if g.GetGet().GetInfo().GetVersion() != v2 || len(files) != 1 || !g.GetGet().GetManifestAttached() {
		t.Fatalf("the waiting reader got version %d with %d descriptors, want %d and the manifest", g.GetGet().GetInfo().GetVersion(), len(files), v2)
	}
	all := make([]byte, len(nc.header)+len(nc.table))
	if _, err := files[0].ReadAt(all, 0); err != nil || !bytes.Equal(all, append(append([]byte{}, nc.header...), nc.table...)) {
		t.Fatalf("the republished version's memfd does not hold the first version's manifest and table (%v)", err)
	}
	protocol.CloseFiles(files)
	// Withdrawn like any version: the withdraw waits for the reader.
	w := pub.withdraw("policy", 30*time.Millisecond)
	wantCode(t, w, storev1.Error_TIMEOUT)
	rel, _ := rd.do(req(&storev1.ReleaseRequest{LeaseId: g.GetGet().GetLeaseId()}))
	wantCode(t, rel, storev1.Error_OK)
	wantCode(t, pub.withdraw("policy", time.Second), storev1.Error_OK)
	// Republished again, from the republished one.
	resp, _ = pub.likeCreate("policy", nc, v2, nil)
	wantCode(t, resp, storev1.Error_OK)
	v3 := resp.GetCreate().GetVersion()

	other := dialRaw(t, path)
	vmmPiece := memfdPiece(t, []byte("y"))
	defer vmmPiece.Close()
	vmm := newNoCopy(t, vmmRegion(t, 0, 2<<20, 2<<20))
	wantCode(t, pub.withdraw("vmm", time.Second), storev1.Error_OK)
	vv := pub.publishNoCopy("vmm", vmm, 1, vmmPiece)
	cases := []struct {
		name string
		rc   *rawClient
		on   string
		nc   noCopy
		like uint64
		mut  func(*storev1.CreateRequest)
		code storev1.Error_Code
	}{
		{"no such version", pub, "policy", nc, v3 + 5, nil, storev1.Error_NOT_FOUND},
		{"an older version", pub, "policy", nc, v2, nil, storev1.Error_NOT_FOUND},
		{"another connection's", other, "policy", nc, v3, nil, storev1.Error_NOT_FOUND},
		{"another size", pub, "policy", nc, v3, func(r *storev1.CreateRequest) { r.Size += 256 }, storev1.Error_INVALID},
		{"another manifest size", pub, "policy", nc, v3, func(r *storev1.CreateRequest) { r.ManifestSize++ }, storev1.Error_INVALID},
		{"another device", pub, "policy", nc, v3, func(r *storev1.CreateRequest) { r.Device = "GPU-00000000-1111-2222-3333-444444444444" }, storev1.Error_INVALID},
		{"vmm regions", pub, "vmm", vmm, vv, nil, storev1.Error_NOT_FOUND},
		{"no sources", pub, "policy", nc, v3, func(r *storev1.CreateRequest) { r.SourcesSize = 0 }, storev1.Error_INVALID},
	}
	for _, c := range cases {
		resp, got := c.rc.likeCreate(c.on, c.nc, c.like, c.mut)
		protocol.CloseFiles(got)
		if code(resp) != c.code {
			t.Errorf("%s: %v, want %v", c.name, resp.GetError(), c.code)
		}
	}
	// Nothing was left by the refusals: the next version is v3 + 1.
	wantCode(t, pub.withdraw("policy", time.Second), storev1.Error_OK)
	if v := pub.publishNoCopy("policy", nc, 1); v != v3+1 {
		t.Fatalf("next version %d, want %d", v, v3+1)
	}
}

// A publisher that disconnects with a sealed shard of a pending no-copy
// version (shard 0 not created yet) discards the version: no reader ever
// sees it, and the daemon goes on serving.
func TestNoCopyPublisherGoneBeforeVersionComplete(t *testing.T) {
	_, path, _ := serve(t, Config{})
	for _, legacy := range []bool{true, false} {
		pub := dialRaw(t, path)
		piece := memfdPiece(t, make([]byte, 32))
		region, files := vmmRegion(t, 0, 2<<20, 2<<20), []*os.File{piece}
		if legacy {
			region, files = ipcRegion(t, 2<<20, testGPU), nil
		}
		nc := newNoCopy(t, region)
		name := fmt.Sprintf("sharded-%v", legacy)
		pub.id++
		r := &storev1.CreateRequest{Name: name, Size: uint64(nc.size), Device: testGPU, Shared: true, Versioned: true, Shards: 2, Shard: 1,
			ManifestSize: uint64(len(nc.header)), SourcesSize: uint64(len(nc.table)), Files: uint32(len(files))}
		if err := pub.c.Send(&storev1.Request{Id: pub.id, Body: &storev1.Request_Create{Create: r}}, files...); err != nil {
			t.Fatal(err)
		}
		resp, got := pub.recv(pub.id)
		wantCode(t, resp, storev1.Error_OK)
		if _, err := got[0].WriteAt(append(append([]byte{}, nc.header...), nc.table...), 0); err != nil {
			t.Fatal(err)
		}
		protocol.CloseFiles(got)
		v := resp.GetCreate().GetVersion()
		s, _ := pub.do(req(&storev1.SealRequest{Name: name, Version: v, Shard: 1}))
		wantCode(t, s, storev1.Error_OK)
		pub.c.Close()
		piece.Close()

		other := dialRaw(t, path)
		testutil.Eventually(t, testutil.Wait, func() error {
			if g, _ := other.do(req(&storev1.GetRequest{Name: name, Version: v, Shard: 1})); code(g) != storev1.Error_NOT_FOUND {
				return fmt.Errorf("get of the discarded version's shard: %v, want NOT_FOUND", code(g))
			}
			return nil
		})
		g, _ := other.do(req(&storev1.GetRequest{Name: name}))
		wantCode(t, g, storev1.Error_TIMEOUT)
	}
}
