package cudaipc

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"
)

// fakeDriver stands in for libcuda behind the cache's seam. Like the real
// driver it maps a handle once per device and counts opens of an open
// handle (same pointer back) unless newPointers is set.
type fakeDriver struct {
	mu          sync.Mutex
	devs        []*Device
	opens       int      // successful openMem calls
	attempts    int      // all openMem calls
	accesses    []Access // the access of each importFD call
	closes      int
	refs        map[fakeMapKey]int
	ptrs        map[fakeMapKey]DevicePtr
	next        DevicePtr
	failOpen    error
	delay       time.Duration // in openMem
	closeDelay  time.Duration // in closeMem
	closing     map[fakeMapKey]bool
	closeBegun  chan struct{} // if set, told when a close is in flight
	violations  []string
	newPointers bool // every open maps anew (a driver that does not refcount by handle)
	ids         map[DevicePtr]uint64
	allocSize   int64            // what openIPC and allocation report; 8 MiB by default
	fdSizes     map[string]int64 // the allocation behind each descriptor, by file name
	fdImports   int
	fdUnmaps    int
	evOpens     int
	evCloses    int
}

type fakeMapKey struct {
	dev UUID
	h   MemHandle
}

func newFakeDriver(ndev int) *fakeDriver {
	f := &fakeDriver{refs: map[fakeMapKey]int{}, ptrs: map[fakeMapKey]DevicePtr{}, closing: map[fakeMapKey]bool{}, next: 0x7000_0000_0000, ids: map[DevicePtr]uint64{},
		allocSize: 8 << 20, fdSizes: map[string]int64{}}
	for i := 0; i < ndev; i++ {
		f.devs = append(f.devs, &Device{ordinal: i, name: "fake", uuid: UUID{0xf0, byte(i + 1)}})
	}
	return f
}

func (f *fakeDriver) devices() ([]*Device, error) { return f.devs, nil }

func (f *fakeDriver) openIPC(d *Device, h MemHandle) (DevicePtr, int64, error) {
	p, err := f.openMem(d, h)
	f.mu.Lock()
	defer f.mu.Unlock()
	return p, f.allocSize, err
}

func (f *fakeDriver) openMem(d *Device, h MemHandle) (DevicePtr, error) {
	f.mu.Lock()
	f.attempts++
	delay, fail := f.delay, f.failOpen
	f.mu.Unlock()
	time.Sleep(delay)
	f.mu.Lock()
	defer f.mu.Unlock()
	if fail != nil {
		return 0, fail
	}
	k := fakeMapKey{d.uuid, h}
	if f.closing[k] {
		f.violations = append(f.violations, "open while a close of the same handle is in flight")
	}
	f.opens++
	if f.refs[k] > 0 && !f.newPointers {
		f.refs[k]++
		return f.ptrs[k], nil
	}
	f.next += 1 << 30
	if f.newPointers {
		k.h[63] ^= byte(f.opens) // keep each mapping apart
	}
	f.refs[k], f.ptrs[k] = 1, f.next
	return f.next, nil
}

func (f *fakeDriver) closeIPC(d *Device, base DevicePtr) error {
	f.mu.Lock()
	var key fakeMapKey
	found := false
	for k, p := range f.ptrs {
		if p == base && k.dev == d.uuid && f.refs[k] > 0 {
			key, found = k, true
		}
	}
	if !found {
		f.mu.Unlock()
		return ErrInvalidValue
	}
	f.closing[key] = true
	delay := f.closeDelay
	if f.closeBegun != nil {
		select {
		case f.closeBegun <- struct{}{}:
		default:
		}
	}
	f.mu.Unlock()
	time.Sleep(delay)
	f.mu.Lock()
	defer f.mu.Unlock()
	f.closing[key] = false
	f.closes++
	f.refs[key]--
	return nil
}

func (f *fakeDriver) allocation(d *Device, p DevicePtr) (DevicePtr, int64, uint64, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	id, ok := f.ids[p]
	if !ok {
		return 0, 0, 0, ErrInvalidValue
	}
	return p, f.allocSize, id, nil
}

// importPieces maps the allocations files stand for back to back, 2 MiB
// granular (one piece rounded up); more than fdSizes says one holds fails
// as the H200 driver fails.
func (f *fakeDriver) importPieces(d *Device, files []*os.File, sizes []int64, a Access) (vmmMapping, error) {
	f.mu.Lock()
	f.attempts++
	f.accesses = append(f.accesses, a)
	delay, fail := f.delay, f.failOpen
	f.mu.Unlock()
	time.Sleep(delay)
	f.mu.Lock()
	defer f.mu.Unlock()
	if fail != nil {
		return vmmMapping{}, fail
	}
	var m vmmMapping
	for i, file := range files {
		have, ok := f.fdSizes[file.Name()]
		if !ok {
			return vmmMapping{}, ErrInvalidValue
		}
		size, rounded := sizes[i], sizes[i]
		if len(files) == 1 {
			rounded = (size + 2<<20 - 1) / (2 << 20) * (2 << 20)
		} else if size%(2<<20) != 0 {
			return vmmMapping{}, &ArgError{Op: "Import", Arg: "size", Reason: "not a multiple of the granularity"}
		}
		if rounded > have {
			return vmmMapping{}, &mapSizeError{piece: i, pieces: len(files), size: size, rounded: rounded, err: ErrNotSupported}
		}
		m.handles = append(m.handles, 1)
		m.sizes = append(m.sizes, rounded)
		m.size += rounded
	}
	f.fdImports++
	f.next += 1 << 40
	m.ptr = f.next
	return m, nil
}

func (f *fakeDriver) unmapPieces(d *Device, m vmmMapping) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.fdUnmaps++
	return nil
}

func (f *fakeDriver) openEvent(d *Device, h EventHandle) (*Event, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.failOpen != nil {
		return nil, f.failOpen
	}
	f.evOpens++
	return &Event{dev: d, imported: true, flags: EventInterprocess | EventDisableTiming}, nil
}

func (f *fakeDriver) closeEvent(e *Event) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.evCloses++
	return nil
}

func (f *fakeDriver) counts() (opens, closes int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.opens, f.closes
}

var testSelf = Identity{PID: 1000, PIDNamespace: 4026531836, BootID: BootID{1, 2, 3}}

func newTestCache(f *fakeDriver) *importCache {
	return newImportCache(f, func() (Identity, error) { return testSelf, nil })
}

// remoteRegion is a region of another process of this host, on device dev.
func remoteRegion(dev UUID, handleByte byte, bufferID uint64) Region {
	r := exampleRegion()
	r.Handle = MemHandle{handleByte, 1}
	r.Device, r.ExporterPID, r.PIDNamespace, r.BootID = dev, 2000, testSelf.PIDNamespace, testSelf.BootID
	r.BufferID = bufferID
	r.Offset, r.Size = 0, r.AllocSize
	return r
}

func closeAll(t testing.TB, ms []*Mapping) {
	t.Helper()
	for _, m := range ms {
		if err := m.Close(); err != nil {
			t.Fatal(err)
		}
	}
}

// mustImport imports r through c, failing the test on an error.
func mustImport(t testing.TB, c *importCache, r Region, opts ...ImportOption) *Mapping {
	t.Helper()
	m, err := c.importMem(r, opts...)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

func TestCacheThousandImportsOneOpen(t *testing.T) {
	f := newFakeDriver(1)
	c := newTestCache(f)
	r := remoteRegion(f.devs[0].uuid, 1, 7)
	before := LiveObjects().Mappings
	var ms []*Mapping
	for i := int64(0); i < 1000; i++ {
		sub, err := r.Sub(i*4096, 4096)
		if err != nil {
			t.Fatal(err)
		}
		m := mustImport(t, c, sub)
		if m.Ptr() != ms0Base(ms, m)+DevicePtr(i*4096) || m.Size() != 4096 || m.Device() != f.devs[0] || m.Local() {
			t.Fatalf("import %d: ptr %#x size %d", i, m.Ptr(), m.Size())
		}
		ms = append(ms, m)
	}
	if o, _ := f.counts(); o != 1 {
		t.Fatalf("%d opens for 1000 imports of one allocation", o)
	}
	if got := LiveObjects().Mappings - before; got != 1000 {
		t.Fatalf("Live.Mappings grew by %d", got)
	}
	if s := c.stats(); s.Opens != 1 || s.Hits != 999 || s.Mapped != 1 {
		t.Fatalf("stats %+v", s)
	}
	closeAll(t, ms[1:])
	if _, cl := f.counts(); cl != 0 {
		t.Fatal("closed while a mapping is open")
	}
	closeAll(t, ms[:1])
	if _, cl := f.counts(); cl != 1 {
		t.Fatalf("%d closes after the last Close", cl)
	}
	if LiveObjects().Mappings != before || c.stats().Mapped != 0 {
		t.Fatal("mappings left")
	}
}

// ms0Base returns the base of the allocation: the first mapping's pointer
// minus its offset.
func ms0Base(ms []*Mapping, m *Mapping) DevicePtr {
	if len(ms) == 0 {
		return m.Ptr() - DevicePtr(m.Region().Offset)
	}
	return ms[0].Ptr() - DevicePtr(ms[0].Region().Offset)
}

func TestCacheConcurrentFirstImportsOpenOnce(t *testing.T) {
	f := newFakeDriver(1)
	f.delay = 20 * time.Millisecond
	c := newTestCache(f)
	r := remoteRegion(f.devs[0].uuid, 2, 7)
	ms := make([]*Mapping, 32)
	errs := make([]error, 32)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := range ms {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			ms[i], errs[i] = c.importMem(r)
		}()
	}
	close(start)
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("goroutine %d: %v", i, err)
		}
		if ms[i].Ptr() != ms[0].Ptr() {
			t.Fatal("goroutines got different mappings")
		}
	}
	if o, _ := f.counts(); o != 1 {
		t.Fatalf("%d opens for 32 concurrent imports", o)
	}
	closeAll(t, ms)
	if _, cl := f.counts(); cl != 1 {
		t.Fatalf("%d closes", cl)
	}
}

func TestCacheFailureIsSharedNotCached(t *testing.T) {
	f := newFakeDriver(1)
	f.delay = 20 * time.Millisecond
	f.failOpen = fmt.Errorf("cuIpcOpenMemHandle: %w", ErrInvalidResourceHandle)
	c := newTestCache(f)
	r := remoteRegion(f.devs[0].uuid, 3, 7)
	var wg sync.WaitGroup
	errs := make([]error, 8)
	for i := range errs {
		wg.Add(1)
		go func() { defer wg.Done(); _, errs[i] = c.importMem(r) }()
	}
	wg.Wait()
	for _, err := range errs {
		if !errors.Is(err, ErrInvalidResourceHandle) {
			t.Fatalf("import: %v", err)
		}
	}
	f.mu.Lock()
	attempts := f.attempts
	f.failOpen, f.delay = nil, 0
	f.mu.Unlock()
	if attempts > len(errs) || attempts < 1 {
		t.Fatalf("%d attempts", attempts)
	}
	m, err := c.importMem(r)
	if err != nil {
		t.Fatalf("the failure was cached: %v", err)
	}
	if o, _ := f.counts(); o != 1 {
		t.Fatalf("%d opens", o)
	}
	closeAll(t, []*Mapping{m})
}

func TestCacheRefcountsAndIdempotentClose(t *testing.T) {
	f := newFakeDriver(1)
	c := newTestCache(f)
	r := remoteRegion(f.devs[0].uuid, 4, 7)
	a := mustImport(t, c, r)
	b := mustImport(t, c, r)
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	if err := a.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if _, cl := f.counts(); cl != 0 {
		t.Fatal("a double Close dropped another mapping's reference")
	}
	if _, err := a.ReadAt(make([]byte, 1), 0); !errors.Is(err, ErrClosed) {
		t.Fatalf("ReadAt after Close: %v", err)
	}
	if _, err := a.WriteAt(make([]byte, 1), 0); !errors.Is(err, ErrClosed) {
		t.Fatalf("WriteAt after Close: %v", err)
	}
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	if _, cl := f.counts(); cl != 1 {
		t.Fatal("last Close did not close")
	}
	// After the last close the next import opens again.
	m := mustImport(t, c, r)
	if o, _ := f.counts(); o != 2 {
		t.Fatalf("%d opens", o)
	}
	closeAll(t, []*Mapping{m})
}

func TestCacheStaleBufferID(t *testing.T) {
	// The driver refcounts by handle: the new open returns the old mapping,
	// which must not be served.
	f := newFakeDriver(1)
	c := newTestCache(f)
	old := remoteRegion(f.devs[0].uuid, 5, 7)
	m1 := mustImport(t, c, old)
	fresh := old
	fresh.BufferID = 8
	_, err := c.importMem(fresh)
	if !errors.Is(err, ErrStaleMapping) || !strings.Contains(err.Error(), "close the old Mappings") {
		t.Fatalf("import of a re-used handle: %v", err)
	}
	if o, cl := f.counts(); o != 2 || cl != 1 {
		t.Fatalf("opens %d closes %d: the extra open was not given back", o, cl)
	}
	if s := c.stats(); s.Stale != 1 {
		t.Fatalf("stats %+v", s)
	}
	// The old holder is untouched; importing the old region again does not
	// revive the stale entry as the cache's current one.
	if m1.ref.isClosed() {
		t.Fatal("old mapping closed")
	}
	if err := m1.Close(); err != nil {
		t.Fatal(err)
	}
	m2, err := c.importMem(fresh)
	if err != nil {
		t.Fatalf("after the old mapping closed: %v", err)
	}
	if o, cl := f.counts(); o != 3 || cl != 2 {
		t.Fatalf("opens %d closes %d", o, cl)
	}
	closeAll(t, []*Mapping{m2})

	// A driver that maps anew: the new import gets its own mapping while the
	// stale one stays with its holder.
	f = newFakeDriver(1)
	f.newPointers = true
	c = newTestCache(f)
	m1 = mustImport(t, c, old)
	m2 = mustImport(t, c, fresh)
	if m1.Ptr() == m2.Ptr() {
		t.Fatal("stale entry reused")
	}
	m3, err := c.importMem(fresh)
	if err != nil || m3.Ptr() != m2.Ptr() {
		t.Fatalf("the new entry is not cached: %v", err)
	}
	if s := c.stats(); s.Opens != 2 || s.Mapped != 2 {
		t.Fatalf("stats %+v", s)
	}
	closeAll(t, []*Mapping{m1, m2, m3})
	if o, cl := f.counts(); o != 2 || cl != 2 {
		t.Fatalf("opens %d closes %d", o, cl)
	}
}

func TestCacheWaitsForInFlightClose(t *testing.T) {
	f := newFakeDriver(1)
	f.closeDelay = 30 * time.Millisecond
	f.closeBegun = make(chan struct{}, 1)
	c := newTestCache(f)
	r := remoteRegion(f.devs[0].uuid, 6, 7)
	m := mustImport(t, c, r)
	done := make(chan error)
	go func() { done <- m.Close() }()
	select { // the import below comes while the close is in the driver
	case <-f.closeBegun:
	case <-time.After(30 * time.Second):
		t.Fatal("the close never reached the driver")
	}
	r2 := r
	r2.BufferID = 9 // even for another allocation: it must not get the dying mapping
	m2 := mustImport(t, c, r2)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if len(f.violations) != 0 {
		t.Fatal(f.violations)
	}
	closeAll(t, []*Mapping{m2})
}

func TestCacheOtherHostAndPIDNamespace(t *testing.T) {
	f := newFakeDriver(1)
	c := newTestCache(f)
	r := remoteRegion(f.devs[0].uuid, 7, 7)
	r.BootID = BootID{9}
	_, err := c.importMem(r)
	if !errors.Is(err, ErrOtherHost) || !strings.Contains(err.Error(), "copy the bytes") {
		t.Fatalf("other boot: %v", err)
	}
	if o, _ := f.counts(); o != 0 {
		t.Fatal("the driver was called for a refused region")
	}
	r = remoteRegion(f.devs[0].uuid, 7, 7)
	r.PIDNamespace = 1234
	_, err = c.importMem(r)
	if !errors.Is(err, ErrOtherPIDNamespace) || !strings.Contains(err.Error(), "serve --gpu-share fd") || strings.Contains(err.Error(), "WithAnyPIDNamespace") || strings.Count(err.Error(), "cudaipc:") != 1 {
		t.Fatalf("other PID namespace: %v", err)
	}
	// Opting in tries the driver (nested namespaces work); a pid equal to
	// ours in another namespace is not this process.
	opens, _ := f.counts()
	r.ExporterPID = testSelf.PID
	m, err := c.importMem(r, WithAnyPIDNamespace())
	after, _ := f.counts()
	if err != nil || m.Local() || after != opens+1 {
		t.Fatalf("WithAnyPIDNamespace: %v (local %v, opens %d -> %d)", err, m != nil && m.Local(), opens, after)
	}
	m.Close()
	d := exampleEvent()
	d.BootID, d.PIDNamespace = testSelf.BootID, 99
	_, err = c.importEvent(d)
	if !errors.Is(err, ErrOtherPIDNamespace) {
		t.Fatalf("event from another PID namespace: %v", err)
	}
	r.Size = 0
	if _, err := c.importMem(r); !errors.Is(err, ErrInvalidRegion) {
		t.Fatalf("invalid region: %v", err)
	}
	if o, _ := f.counts(); o != 1 {
		t.Fatalf("the driver was called %d times, want only the opted-in open", o)
	}
}

func TestCacheTargetDeviceByUUID(t *testing.T) {
	f := newFakeDriver(3)
	c := newTestCache(f)
	// The exporter's GPU is this process's ordinal 2.
	m, err := c.importMem(remoteRegion(f.devs[2].uuid, 8, 7))
	if err != nil || m.Device() != f.devs[2] {
		t.Fatalf("mapped through %v: %v", m.Device(), err)
	}
	// The fallback option does not override a visible GPU.
	m2, err := c.importMem(remoteRegion(f.devs[2].uuid, 8, 7), WithFallbackDevice(f.devs[1]))
	if err != nil || m2.Device() != f.devs[2] || m2.Ptr() != m.Ptr() {
		t.Fatalf("mapped through %v: %v", m2.Device(), err)
	}
	// A hidden GPU: the first visible one, or the fallback.
	hidden := UUID{0xee}
	m3, err := c.importMem(remoteRegion(hidden, 9, 7))
	if err != nil || m3.Device() != f.devs[0] {
		t.Fatalf("hidden GPU mapped through %v: %v", m3.Device(), err)
	}
	m4, err := c.importMem(remoteRegion(hidden, 9, 7), WithFallbackDevice(f.devs[1]))
	if err != nil || m4.Device() != f.devs[1] {
		t.Fatalf("fallback: %v %v", m4.Device(), err)
	}
	if o, _ := f.counts(); o != 3 {
		t.Fatalf("%d opens: want one per (handle, device)", o)
	}
	closeAll(t, []*Mapping{m, m2, m3, m4})
	c = newTestCache(&fakeDriver{})
	if _, err := c.importMem(remoteRegion(hidden, 9, 7)); !errors.Is(err, ErrNoDevice) {
		t.Fatalf("no devices: %v", err)
	}
}

func TestCacheSameProcess(t *testing.T) {
	f := newFakeDriver(1)
	c := newTestCache(f)
	dev := f.devs[0]
	// A Buffer of this package, as Alloc and Export leave it.
	b := &Buffer{deviceRange: deviceRange{what: "Buffer", dev: dev, ptr: 0x5000_0000_0000, size: 1 << 20}, bufferID: 42, allocSize: 1 << 20}
	registerBuffer(b)
	defer unregisterBuffer(b.ptr, b)
	r := remoteRegion(dev.uuid, 10, 42)
	r.ExporterPID, r.ExporterBase, r.AllocSize, r.Offset, r.Size = testSelf.PID, b.ptr, b.size, 4096, 8192
	m := mustImport(t, c, r)
	if !m.Local() || m.Ptr() != b.ptr+4096 || m.Device() != dev {
		t.Fatalf("local import at %#x", m.Ptr())
	}
	if err := b.Free(); !errors.Is(err, ErrInUse) {
		t.Fatalf("Free while mapped: %v", err)
	}
	m2, _ := c.importMem(r)
	closeAll(t, []*Mapping{m, m2})
	if b.localRefs != 0 {
		t.Fatalf("%d local refs left", b.localRefs)
	}
	// A region of an earlier allocation at the same address.
	r.BufferID = 41
	if _, err := c.importMem(r); !errors.Is(err, ErrStaleMapping) {
		t.Fatalf("old buffer id: %v", err)
	}
	// An allocation of another library: checked through the driver.
	f.ids[0x6000_0000_0000] = 99
	r.ExporterBase, r.BufferID = 0x6000_0000_0000, 99
	m3, err := c.importMem(r)
	if err != nil || m3.Ptr() != 0x6000_0000_0000+4096 {
		t.Fatalf("foreign allocation: %v", err)
	}
	closeAll(t, []*Mapping{m3})
	f.ids[0x6000_0000_0000] = 100
	if _, err := c.importMem(r); !errors.Is(err, ErrStaleMapping) {
		t.Fatalf("freed foreign allocation: %v", err)
	}
	if o, _ := f.counts(); o != 0 {
		t.Fatal("same-process import called the driver's open")
	}
}

func TestCacheLeakedMappingIsReleased(t *testing.T) {
	f := newFakeDriver(1)
	c := newTestCache(f)
	before := LiveObjects().Mappings
	func() {
		m := mustImport(t, c, remoteRegion(f.devs[0].uuid, 11, 7))
		_ = m.Ptr()
	}()
	deadline := time.Now().Add(5 * time.Second)
	for {
		runtime.GC()
		if _, cl := f.counts(); cl == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the cleanup did not close the dropped Mapping")
		}
		time.Sleep(time.Millisecond)
	}
	for LiveObjects().Mappings != before && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	if LiveObjects().Mappings != before {
		t.Fatal("Live.Mappings not restored")
	}
}

func TestCacheEvents(t *testing.T) {
	f := newFakeDriver(2)
	c := newTestCache(f)
	d := exampleEvent()
	d.Device, d.PIDNamespace, d.BootID, d.ExporterPID = f.devs[1].uuid, testSelf.PIDNamespace, testSelf.BootID, 2000
	var evs []*RemoteEvent
	for i := 0; i < 100; i++ {
		e, err := c.importEvent(d)
		if err != nil {
			t.Fatal(err)
		}
		if e.Device() != f.devs[1] {
			t.Fatalf("event opened on %v", e.Device())
		}
		evs = append(evs, e)
	}
	if f.evOpens != 1 {
		t.Fatalf("%d event opens", f.evOpens)
	}
	for _, e := range evs {
		if err := e.Close(); err != nil {
			t.Fatal(err)
		}
		if err := e.Close(); err != nil {
			t.Fatal(err)
		}
	}
	if f.evCloses != 1 {
		t.Fatalf("%d event closes", f.evCloses)
	}
	if _, err := evs[0].Done(); !errors.Is(err, ErrClosed) {
		t.Fatalf("Done after Close: %v", err)
	}
	// The exporting process gets its own event back.
	own := &Event{dev: f.devs[0], flags: EventInterprocess | EventDisableTiming}
	d.ExporterPID = testSelf.PID
	if _, err := c.importEvent(d); !errors.Is(err, ErrClosed) {
		t.Fatalf("unknown own event: %v", err)
	}
	exportedEvents.mu.Lock()
	exportedEvents.m = map[EventHandle]*Event{d.Handle: own}
	exportedEvents.mu.Unlock()
	own.exported = &d.Handle
	e, err := c.importEvent(d)
	if err != nil || e.ev != own {
		t.Fatalf("own event: %v", err)
	}
	if err := e.Close(); err != nil || f.evCloses != 1 {
		t.Fatal("closing the import of an own event destroyed something")
	}
	own.mu.Lock()
	own.unregisterExported()
	own.mu.Unlock()
}

// BenchmarkImportCachedFake is the cached Import+Close on a CPU: the cost
// of the cache itself, without the driver.
func BenchmarkImportCachedFake(b *testing.B) {
	f := newFakeDriver(1)
	c := newTestCache(f)
	r := remoteRegion(f.devs[0].uuid, 12, 7)
	keep, err := c.importMem(r)
	if err != nil {
		b.Fatal(err)
	}
	defer keep.Close()
	sub, _ := r.Sub(4096, 4096)
	b.ReportAllocs()
	for b.Loop() {
		m, err := c.importMem(sub)
		if err != nil {
			b.Fatal(err)
		}
		if err := m.Close(); err != nil {
			b.Fatal(err)
		}
	}
	if o, _ := f.counts(); o != 1 {
		b.Fatalf("%d opens", o)
	}
}

// vmmRegion is a vmm-fd region of another process, in another PID
// namespace: descriptors cross namespaces.
func vmmRegion(dev UUID, id byte, allocSize int64) Region {
	r := exampleVMMRegion()
	r.AllocationID = AllocationID{id, 0xaa}
	r.Device, r.ExporterPID, r.PIDNamespace, r.BootID = dev, 7, 4026532999, testSelf.BootID
	r.Offset, r.Size, r.AllocSize = 0, allocSize, allocSize
	return r
}

// fakeFD returns a file whose name the fake driver knows as a descriptor
// of an allocation of size bytes.
func fakeFD(t testing.TB, f *fakeDriver, size int64) *os.File {
	t.Helper()
	file, err := os.CreateTemp(t.TempDir(), "fd")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { file.Close() })
	f.mu.Lock()
	f.fdSizes[file.Name()] = size
	f.mu.Unlock()
	return file
}

func TestCacheVMMFD(t *testing.T) {
	f := newFakeDriver(2)
	c := newTestCache(f)
	r := vmmRegion(f.devs[1].uuid, 1, 8<<20)
	fd := fakeFD(t, f, 8<<20)
	var ms []*Mapping
	for i := int64(0); i < 100; i++ {
		sub, _ := r.Sub(i*4096, 4096)
		m := mustImport(t, c, sub, WithFile(fd))
		if m.Device() != f.devs[1] || m.Local() || m.Ptr() != ms0Base(ms, m)+DevicePtr(i*4096) {
			t.Fatalf("import %d: %v at %#x", i, m.Device(), m.Ptr())
		}
		ms = append(ms, m)
	}
	if f.fdImports != 1 {
		t.Fatalf("%d descriptor imports for 100 regions of one allocation", f.fdImports)
	}
	if s := c.stats(); s.Opens != 1 || s.Hits != 99 || s.Mapped != 1 {
		t.Fatalf("stats %+v", s)
	}
	// Another allocation id is another mapping, even with the same
	// descriptor: the id, not the descriptor, names the allocation.
	other := vmmRegion(f.devs[1].uuid, 2, 8<<20)
	m2, err := c.importMem(other, WithFile(fd))
	if err != nil || m2.Ptr() == ms[0].Ptr() || f.fdImports != 2 {
		t.Fatalf("second allocation: %v, %d imports", err, f.fdImports)
	}
	closeAll(t, append(ms, m2))
	if f.fdUnmaps != 2 || c.stats().Mapped != 0 {
		t.Fatalf("%d unmaps, %+v", f.fdUnmaps, c.stats())
	}
	// Once closed, the allocation is imported again from a descriptor.
	m3, err := c.importMem(r, WithFile(fd))
	if err != nil || f.fdImports != 3 {
		t.Fatalf("re-import: %v, %d imports", err, f.fdImports)
	}
	closeAll(t, []*Mapping{m3})
}

// Read-only and read-write imports of one allocation are two driver
// mappings, each shared by the imports of its kind.
func TestCacheVMMFDAccess(t *testing.T) {
	f := newFakeDriver(1)
	c := newTestCache(f)
	r := vmmRegion(f.devs[0].uuid, 1, 4<<20)
	fd := fakeFD(t, f, 4<<20)
	ro1 := mustImport(t, c, r, WithFile(fd), WithAccess(ReadOnly))
	ro2 := mustImport(t, c, r, WithFile(fd), WithAccess(ReadOnly))
	rw := mustImport(t, c, r, WithFile(fd))
	if ro1.Ptr() != ro2.Ptr() || rw.Ptr() == ro1.Ptr() || f.fdImports != 2 {
		t.Fatalf("ro %#x %#x, rw %#x, %d imports: want one read-only and one read-write mapping", ro1.Ptr(), ro2.Ptr(), rw.Ptr(), f.fdImports)
	}
	if len(f.accesses) != 2 || f.accesses[0] != ReadOnly || f.accesses[1] != ReadWrite {
		t.Fatalf("driver asked for %v", f.accesses)
	}
	closeAll(t, []*Mapping{ro1, ro2, rw})
}

func TestCacheVMMFDRefusals(t *testing.T) {
	f := newFakeDriver(1)
	c := newTestCache(f)
	dev := f.devs[0].uuid
	var ae *ArgError
	if _, err := c.importMem(vmmRegion(dev, 1, 2<<20)); !errors.As(err, &ae) || ae.Arg != "file" || !strings.Contains(err.Error(), "WithFile") {
		t.Fatalf("vmm-fd without a descriptor: %v", err)
	}
	fd := fakeFD(t, f, 2<<20)
	if _, err := c.importMem(remoteRegion(dev, 1, 7), WithFile(fd)); !errors.As(err, &ae) || ae.Arg != "file" {
		t.Fatalf("cuda-ipc with a descriptor: %v", err)
	}
	r := vmmRegion(dev, 1, 2<<20)
	r.BootID = BootID{9}
	if _, err := c.importMem(r, WithFile(fd)); !errors.Is(err, ErrOtherHost) {
		t.Fatalf("vmm-fd of another boot: %v", err)
	}
	// A region that claims more than the descriptor's allocation holds is
	// refused by name, before any mapping is served.
	big := vmmRegion(dev, 3, 4<<20)
	_, err := c.importMem(big, WithFile(fd))
	var re *RegionError
	if !errors.As(err, &re) || re.Field != "alloc_size" || !strings.Contains(err.Error(), "4194304") {
		t.Fatalf("vmm-fd region larger than its allocation: %v", err)
	}
	if f.fdImports != 0 || c.stats().Mapped != 0 {
		t.Fatalf("%d imports, %+v after refusals", f.fdImports, c.stats())
	}
	// Once mapped at its real size, a region of the same id claiming more
	// is refused without a driver call, and the mapping stays for others.
	ok := mustImport(t, c, vmmRegion(dev, 3, 2<<20), WithFile(fd))
	if _, err := c.importMem(big, WithFile(fd)); !errors.As(err, &re) || re.Field != "alloc_size" {
		t.Fatalf("cached allocation, larger region: %v", err)
	}
	if s := c.stats(); s.Mapped != 1 || f.fdUnmaps != 0 {
		t.Fatalf("the refusal released another's mapping: %+v, %d unmaps", s, f.fdUnmaps)
	}
	closeAll(t, []*Mapping{ok})
	if f.fdUnmaps != 1 {
		t.Fatalf("%d unmaps", f.fdUnmaps)
	}
}

func TestCacheAllocSizeLargerThanAllocation(t *testing.T) {
	f := newFakeDriver(1)
	f.allocSize = 1 << 20 // what the driver finds behind the handle
	c := newTestCache(f)
	r := remoteRegion(f.devs[0].uuid, 40, 7) // claims 8 MiB
	_, err := c.importMem(r)
	var re *RegionError
	if !errors.As(err, &re) || re.Field != "alloc_size" || !errors.Is(err, ErrInvalidRegion) ||
		!strings.Contains(err.Error(), "8388608") || !strings.Contains(err.Error(), "1048576") {
		t.Fatalf("region larger than its allocation: %v", err)
	}
	if o, cl := f.counts(); o != 1 || cl != 1 || c.stats().Mapped != 0 {
		t.Fatalf("opens %d closes %d: the refused open was not given back", o, cl)
	}
	// A region within the allocation imports.
	r.AllocSize, r.Size = 1<<20, 1<<20
	m := mustImport(t, c, r)
	closeAll(t, []*Mapping{m})
	// In the exporting process, the driver's size of the allocation is
	// checked too.
	f.ids[0x6000_0000_0000] = 99
	r.ExporterPID, r.ExporterBase, r.BufferID, r.AllocSize = testSelf.PID, 0x6000_0000_0000, 99, 2<<20
	if _, err := c.importMem(r); !errors.As(err, &re) || re.Field != "alloc_size" {
		t.Fatalf("local region larger than its allocation: %v", err)
	}
	b := &Buffer{deviceRange: deviceRange{what: "Buffer", dev: f.devs[0], ptr: 0x5000_0000_0000, size: 1 << 20}, bufferID: 42, allocSize: 1 << 20}
	registerBuffer(b)
	defer unregisterBuffer(b.ptr, b)
	r.ExporterBase, r.BufferID = b.ptr, 42
	if _, err := c.importMem(r); !errors.As(err, &re) || re.Field != "alloc_size" || b.localRefs != 0 {
		t.Fatalf("local Buffer region larger than the Buffer: %v", err)
	}
}

// piecesRegion is a version 2 region over n allocations of piece bytes
// each, ids {first+i, 0xbb}, covering all of them.
func piecesRegion(dev UUID, first byte, n int, piece int64) Region {
	r := vmmRegion(dev, first, piece)
	r.AllocationID = AllocationID{first, 0xbb}
	r.Version = RegionVersionPieces
	for i := 1; i < n; i++ {
		r.MorePieces = append(r.MorePieces, Piece{AllocationID{first + byte(i), 0xbb}, piece})
	}
	r.Size = int64(n) * piece
	return r
}

// A region over several allocations is one driver mapping of all of them,
// shared by every import of those pieces in that order (at any offset, in
// any piece); other pieces, or the same in another order, are another.
func TestCacheVMMFDPieces(t *testing.T) {
	f := newFakeDriver(1)
	c := newTestCache(f)
	const g = 2 << 20
	dev := f.devs[0].uuid
	r := piecesRegion(dev, 1, 3, g)
	files := []*os.File{fakeFD(t, f, g), fakeFD(t, f, g), fakeFD(t, f, g)}
	whole := mustImport(t, c, r, WithFiles(files...), WithAccess(ReadOnly))
	var ms []*Mapping
	for _, off := range []int64{0, g - 1, g, 2*g + 5} {
		sub, _ := r.Sub(off, 1)
		m := mustImport(t, c, sub, WithFiles(files...), WithAccess(ReadOnly))
		if m.Ptr() != whole.Ptr()+DevicePtr(off) || m.Size() != 1 {
			t.Fatalf("part at %d: %#x, want %#x", off, m.Ptr(), whole.Ptr()+DevicePtr(off))
		}
		ms = append(ms, m)
	}
	if f.fdImports != 1 || c.stats().Hits != 4 {
		t.Fatalf("%d imports, %+v: want one mapping of the three pieces", f.fdImports, c.stats())
	}
	// The same allocations in another order lie elsewhere: another mapping.
	swapped := r
	swapped.MorePieces = []Piece{r.MorePieces[1], r.MorePieces[0]}
	m2, err := c.importMem(swapped, WithFiles(files[0], files[2], files[1]), WithAccess(ReadOnly))
	if err != nil || f.fdImports != 2 || m2.Ptr() == whole.Ptr() {
		t.Fatalf("pieces in another order: %v, %d imports", err, f.fdImports)
	}
	// The first piece alone (a version 1 region) is its own mapping too.
	one := vmmRegion(dev, 1, g)
	one.AllocationID = r.AllocationID
	m3, err := c.importMem(one, WithFile(files[0]), WithAccess(ReadOnly))
	if err != nil || f.fdImports != 3 {
		t.Fatalf("first piece alone: %v, %d imports", err, f.fdImports)
	}
	closeAll(t, append(ms, whole, m2, m3))
	if f.fdUnmaps != 3 || c.stats().Mapped != 0 {
		t.Fatalf("%d unmaps, %+v", f.fdUnmaps, c.stats())
	}
}

func TestCacheVMMFDPiecesRefusals(t *testing.T) {
	f := newFakeDriver(1)
	c := newTestCache(f)
	const g = 2 << 20
	r := piecesRegion(f.devs[0].uuid, 1, 3, g)
	a, b := fakeFD(t, f, g), fakeFD(t, f, g)
	var ae *ArgError
	for name, files := range map[string][]*os.File{"two for three": {a, b}, "four for three": {a, b, a, b}, "a nil one": {a, nil, b}} {
		if _, err := c.importMem(r, WithFiles(files...)); !errors.As(err, &ae) || ae.Arg != "file" {
			t.Fatalf("%s: %v", name, err)
		}
	}
	// A piece larger than its descriptor's allocation is refused by name.
	small := fakeFD(t, f, g/2)
	_, err := c.importMem(r, WithFiles(a, small, b))
	var re *RegionError
	if !errors.As(err, &re) || re.Field != "alloc_size" {
		t.Fatalf("a piece past its allocation: %v", err)
	}
	// Pieces must lie on the granularity: they are mapped back to back.
	odd := piecesRegion(f.devs[0].uuid, 10, 2, g+4096)
	if _, err := c.importMem(odd, WithFiles(fakeFD(t, f, 2*g), fakeFD(t, f, 2*g))); !errors.As(err, &ae) || ae.Arg != "size" {
		t.Fatalf("pieces off the granularity: %v", err)
	}
	if f.fdImports != 0 || c.stats().Mapped != 0 {
		t.Fatalf("%d imports, %+v after refusals", f.fdImports, c.stats())
	}
}
