package cudaipc_test

import (
	"bytes"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/internal/testutil"
)

// roleTimelineProducer runs in a sibling container: it maps the data
// buffer (descriptor 3) and the timeline (descriptor 4), queues a write of
// random bytes from SEED behind seconds of busy copies, then Signal(1),
// says "queued", and waits for its stream.
func roleTimelineProducer(p *testutil.Peer) error {
	dev, err := helperDevice()
	if err != nil {
		return err
	}
	size, _ := strconv.ParseInt(os.Getenv("SIZE"), 10, 64)
	seed, _ := strconv.ParseUint(os.Getenv("SEED"), 10, 64)
	data, err := dev.ImportFD(os.NewFile(3, "data"), size)
	if err != nil {
		return err
	}
	defer data.Close()
	tl, err := dev.ImportTimeline(os.NewFile(4, "timeline"))
	if err != nil {
		return err
	}
	defer tl.Close()
	late, err := newLateWriter(dev)
	defer late.close()
	if err != nil {
		return err
	}
	return late.write(p, data.Ptr(), size, seed, func(s *cudaipc.Stream) error { return tl.Signal(s, 1) })
}

// A consumer's stream that waits on a Timeline reads what a producer in a
// sibling container (own PID, mount and IPC namespaces and /dev/shm,
// non-root, no capabilities) wrote, although the write landed long after
// the producer queued it: the counter, not luck, orders the read. No IPC
// event and no shared /dev/shm is involved.
func TestTimelineOrdersAcrossContainers(t *testing.T) {
	dev := testutil.RequireGPU(t)
	testutil.RequireContainers(t)
	if !dev.StreamMemOpsSupported() {
		t.Fatalf("%s: no 64-bit stream memory operations", dev)
	}
	const size = 8 << 20
	data, err := dev.AllocShareable(size)
	if err != nil {
		t.Fatal(err)
	}
	defer data.Free()
	old := testutil.RandomBytes(uint64(time.Now().UnixNano()), size)
	if _, err := data.WriteAt(old, 0); err != nil {
		t.Fatal(err)
	}
	tl, err := dev.NewTimeline()
	if err != nil {
		t.Fatal(err)
	}
	defer tl.Close()
	df, err := data.ExportFD()
	if err != nil {
		t.Fatal(err)
	}
	defer df.Close()
	tf, err := tl.ExportFD()
	if err != nil {
		t.Fatal(err)
	}
	defer tf.Close()

	seed := uint64(time.Now().UnixNano()) + 1
	ctr := testutil.Container{Share: t.TempDir(), UID: 10001, GID: 10001}
	o, err := ctr.SpawnOptions("SIZE="+strconv.Itoa(size), "SEED="+strconv.FormatUint(seed, 10), "DEVICE="+dev.UUID().String())
	if err != nil {
		t.Fatal(err)
	}
	o.ExtraFiles = []*os.File{df, tf}
	c := testutil.SpawnWith(t, "timelineProducer", o)
	var m map[string]string
	if err := c.Recv(&m); err != nil || m["queued"] != "yes" {
		t.Fatalf("producer: %v %v\n%s", m, err, c.Stderr())
	}
	early, err := tl.Value()
	if err != nil {
		t.Fatal(err)
	}
	s, err := dev.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	dst, err := dev.Alloc(size)
	if err != nil {
		t.Fatal(err)
	}
	defer dst.Free()
	if err := tl.Wait(s, 1); err != nil {
		t.Fatal(err)
	}
	if err := s.CopyAsync(dst.Ptr(), data.Ptr(), size); err != nil {
		t.Fatal(err)
	}
	if err := s.Synchronize(); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, size)
	if _, err := dst.ReadAt(got, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, testutil.RandomBytes(seed, size)) {
		t.Fatalf("the consumer read before the producer's write (old bytes: %v)", bytes.Equal(got, old))
	}
	if early != 0 {
		t.Logf("the counter was already %d when the consumer queued its wait: the write was not late this time, the run proves less", early)
	} else {
		t.Logf("the counter was 0 when the consumer queued its wait; the read still saw the late write")
	}
	if err := c.Wait(time.Minute); err != nil {
		t.Fatalf("producer: %v\n%s", err, c.Stderr())
	}
}

// Timeline's argument checks and lifetime, on one process.
func TestTimelineLocal(t *testing.T) {
	dev := testutil.RequireGPU(t)
	tl, err := dev.NewTimeline()
	if err != nil {
		t.Fatal(err)
	}
	if v, err := tl.Value(); err != nil || v != 0 {
		t.Fatalf("new timeline at %d (%v), want 0", v, err)
	}
	s, err := dev.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if err := tl.Signal(s, 7); err != nil {
		t.Fatal(err)
	}
	if err := tl.Wait(s, 7); err != nil {
		t.Fatal(err)
	}
	if err := s.Synchronize(); err != nil {
		t.Fatal(err)
	}
	if v, err := tl.Value(); err != nil || v != 7 {
		t.Fatalf("after Signal(7): %d (%v)", v, err)
	}
	f, err := tl.ExportFD()
	if err != nil {
		t.Fatal(err)
	}
	imp, err := dev.ImportTimeline(f)
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	if v, err := imp.Value(); err != nil || v != 7 {
		t.Fatalf("imported timeline reads %d (%v), want 7", v, err)
	}
	if _, err := imp.ExportFD(); err == nil {
		t.Fatal("an imported timeline exported")
	}
	if err := tl.Close(); err != nil {
		t.Fatal(err)
	}
	if err := tl.Close(); err != nil {
		t.Fatal("second Close:", err)
	}
	if err := tl.Signal(nil, 8); err == nil {
		t.Fatal("Signal after Close succeeded")
	}
	// The importer's mapping outlives the creator's Close.
	if v, err := imp.Value(); err != nil || v != 7 {
		t.Fatalf("imported timeline after the creator closed: %d (%v)", v, err)
	}
	if err := imp.Close(); err != nil {
		t.Fatal(err)
	}
}
