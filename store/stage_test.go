package store

import (
	"bytes"
	"crypto/rand"
	"fmt"
	"os"
	"testing"

	"github.com/cudaipc/cudaipc/internal/testutil"
	"github.com/cudaipc/cudaipc/protocol"
	"github.com/cudaipc/cudaipc/protocol/storev1"
)

// sendFiles sends body with files attached and returns the answer.
func (rc *rawClient) sendFiles(r *storev1.Request, files ...*os.File) (*storev1.Response, []*os.File) {
	rc.t.Helper()
	rc.id++
	r.Id = rc.id
	if err := rc.c.Send(r, files...); err != nil {
		rc.t.Fatal(err)
	}
	return rc.recv(rc.id)
}

func stageReq() *storev1.Request {
	return &storev1.Request{Body: &storev1.Request_StageFiles{StageFiles: &storev1.StageFilesRequest{}}}
}

func filesReq(lease uint64, from uint32) *storev1.Request {
	return &storev1.Request{Body: &storev1.Request_Files{Files: &storev1.FilesRequest{LeaseId: lease, From: from}}}
}

// openFDs counts this process's open descriptors (the daemon runs in it).
func openFDs(t *testing.T) int {
	t.Helper()
	l, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Skipf("no /proc/self/fd: %v", err)
	}
	return len(l)
}

// A registration of more pieces than a packet carries descriptors: the
// exporter stages all but the last packet's, the register takes them in
// order, and a reader gets the first protocol.MaxFiles with its lease and
// the rest by files requests, each the very file the exporter sent.
func TestRegisterMorePiecesThanAPacket(t *testing.T) {
	const n = 2*protocol.MaxFiles + 13 // three packets each way
	_, path, _ := serveGPU(t, Config{})
	exp := dialRaw(t, path)
	contents := make([][]byte, n)
	files := make([]*os.File, n)
	pieces := make([]int64, n)
	for i := range files {
		contents[i] = make([]byte, 32)
		rand.Read(contents[i])
		files[i] = memfdPiece(t, contents[i])
		defer files[i].Close()
		pieces[i] = 2 << 20
	}
	size := int64(n) * (2 << 20)
	region := vmmRegion(t, 0, size, pieces...)
	for i, chunk := range [][]*os.File{files[:protocol.MaxFiles], files[protocol.MaxFiles : 2*protocol.MaxFiles]} {
		resp, _ := exp.sendFiles(stageReq(), chunk...)
		wantCode(t, resp, storev1.Error_OK)
		if got := resp.GetStageFiles().GetStaged(); got != uint32((i+1)*protocol.MaxFiles) {
			t.Fatalf("staged %d after %d packets", got, i+1)
		}
	}
	r := &storev1.RegisterRequest{Name: "torch/big", Size: uint64(size), Device: testGPU, Shared: true, Region: region, Files: n}
	wantCode(t, exp.register(r, files[2*protocol.MaxFiles:]...), storev1.Error_OK)

	rd := dialRaw(t, path)
	g, got := rd.do(req(&storev1.GetRequest{Name: "torch/big"}))
	wantCode(t, g, storev1.Error_OK)
	p := g.GetGet().GetPlacement()
	if p.GetFiles() != n || len(got) != protocol.MaxFiles || !bytes.Equal(p.GetRegion(), region) {
		t.Fatalf("placement of %d descriptors with %d attached", p.GetFiles(), len(got))
	}
	lease := g.GetGet().GetLeaseId()
	for len(got) < n {
		resp, more := rd.sendFiles(filesReq(lease, uint32(len(got))))
		wantCode(t, resp, storev1.Error_OK)
		if fr := resp.GetFiles(); fr.GetFrom() != uint32(len(got)) || int(fr.GetCount()) != len(more) || len(more) == 0 {
			t.Fatalf("files from %d: %v with %d attached", len(got), fr, len(more))
		}
		got = append(got, more...)
	}
	if len(got) != n {
		t.Fatalf("%d descriptors for %d pieces", len(got), n)
	}
	for i, f := range got {
		if !bytes.Equal(readAll(t, f), contents[i]) {
			t.Fatalf("piece %d: the reader got another file than the exporter sent", i)
		}
	}
	protocol.CloseFiles(got)
	// Past the end, a lease that is not this connection's, one of no
	// registration.
	resp, _ := rd.sendFiles(filesReq(lease, n))
	wantCode(t, resp, storev1.Error_INVALID)
	resp, _ = exp.sendFiles(filesReq(lease, 0))
	wantCode(t, resp, storev1.Error_NOT_FOUND)
	rd.put("plain", 4096, false)
	pg, pf := rd.do(req(&storev1.GetRequest{Name: "plain"}))
	protocol.CloseFiles(pf)
	wantCode(t, pg, storev1.Error_OK)
	resp, _ = rd.sendFiles(filesReq(pg.GetGet().GetLeaseId(), 0))
	wantCode(t, resp, storev1.Error_INVALID)
}

// A register takes every staged descriptor, whether it succeeds or not;
// a count that does not add up is INVALID; a connection that ends with
// descriptors staged leaves none open in the daemon; and one connection
// may not stage without bound.
func TestStagedDescriptorsNeverLeak(t *testing.T) {
	_, path, _ := serveGPU(t, Config{})
	f := memfdPiece(t, []byte("piece"))
	defer f.Close()
	some := func(k int) []*os.File {
		l := make([]*os.File, k)
		for i := range l {
			l[i] = f
		}
		return l
	}
	base := openFDs(t)
	c := dialRaw(t, path)
	resp, _ := c.sendFiles(stageReq(), some(5)...)
	wantCode(t, resp, storev1.Error_OK)
	// 5 staged + 1 attached, but the request says 7.
	bad := &storev1.RegisterRequest{Name: "x", Size: 7 << 20, Device: testGPU, Region: vmmRegion(t, 0, 7<<20, 1<<20, 1<<20, 1<<20, 1<<20, 1<<20, 1<<20, 1<<20), Files: 7}
	wantCode(t, c.register(bad, f), storev1.Error_INVALID)
	// The failed register took the five: now six are needed afresh.
	six := &storev1.RegisterRequest{Name: "x", Size: 6 << 20, Device: testGPU, Region: vmmRegion(t, 0, 6<<20, 1<<20, 1<<20, 1<<20, 1<<20, 1<<20, 1<<20), Files: 6}
	wantCode(t, c.register(six, f), storev1.Error_INVALID)
	resp, _ = c.sendFiles(stageReq(), some(5)...)
	wantCode(t, resp, storev1.Error_OK)
	if s := resp.GetStageFiles().GetStaged(); s != 5 {
		t.Fatalf("staged %d after a register took the earlier ones", s)
	}
	wantCode(t, c.register(six, f), storev1.Error_OK)
	// Staged and never registered: the connection's end closes them.
	resp, _ = c.sendFiles(stageReq(), some(protocol.MaxFiles)...)
	wantCode(t, resp, storev1.Error_OK)
	c.c.Close()
	testutil.Eventually(t, testutil.Wait, func() error {
		if n := openFDs(t); n > base {
			return fmt.Errorf("%d descriptors open, %d before the connection", n, base)
		}
		return nil
	})
	// The bound per connection.
	c = dialRaw(t, path)
	var last *storev1.Response
	for staged := 0; staged <= maxStagedPerConn; staged += protocol.MaxFiles {
		last, _ = c.sendFiles(stageReq(), some(protocol.MaxFiles)...)
		if code(last) != storev1.Error_OK {
			break
		}
	}
	wantCode(t, last, storev1.Error_LIMIT)
	resp, _ = c.sendFiles(stageReq(), f)
	if wantCode(t, resp, storev1.Error_OK); resp.GetStageFiles().GetStaged() != 1 {
		t.Fatalf("staged %d after the limit dropped the rest", resp.GetStageFiles().GetStaged())
	}
}
