package cudaipc

import (
	"errors"
	"fmt"
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
	opens       int // successful openMem calls
	attempts    int // all openMem calls
	closes      int
	refs        map[fakeMapKey]int
	ptrs        map[fakeMapKey]DevicePtr
	next        DevicePtr
	failOpen    error
	delay       time.Duration // in openMem
	closeDelay  time.Duration // in closeMem
	closing     map[fakeMapKey]bool
	violations  []string
	newPointers bool // every open maps anew (a driver that does not refcount by handle)
	ids         map[DevicePtr]uint64
	evOpens     int
	evCloses    int
}

type fakeMapKey struct {
	dev UUID
	h   MemHandle
}

func newFakeDriver(ndev int) *fakeDriver {
	f := &fakeDriver{refs: map[fakeMapKey]int{}, ptrs: map[fakeMapKey]DevicePtr{}, closing: map[fakeMapKey]bool{}, next: 0x7000_0000_0000, ids: map[DevicePtr]uint64{}}
	for i := 0; i < ndev; i++ {
		f.devs = append(f.devs, &Device{ordinal: i, name: "fake", uuid: UUID{0xf0, byte(i + 1)}})
	}
	return f
}

func (f *fakeDriver) devices() ([]*Device, error) { return f.devs, nil }

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

func (f *fakeDriver) closeMem(d *Device, base DevicePtr) error {
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
	f.mu.Unlock()
	time.Sleep(delay)
	f.mu.Lock()
	defer f.mu.Unlock()
	f.closing[key] = false
	f.closes++
	f.refs[key]--
	return nil
}

func (f *fakeDriver) bufferID(d *Device, p DevicePtr) (uint64, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	id, ok := f.ids[p]
	if !ok {
		return 0, ErrInvalidValue
	}
	return id, nil
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
		m, err := c.importMem(sub)
		if err != nil {
			t.Fatal(err)
		}
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
	a, err := c.importMem(r)
	if err != nil {
		t.Fatal(err)
	}
	b, err := c.importMem(r)
	if err != nil {
		t.Fatal(err)
	}
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
	m, err := c.importMem(r)
	if err != nil {
		t.Fatal(err)
	}
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
	m1, err := c.importMem(old)
	if err != nil {
		t.Fatal(err)
	}
	fresh := old
	fresh.BufferID = 8
	_, err = c.importMem(fresh)
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
	m1, err = c.importMem(old)
	if err != nil {
		t.Fatal(err)
	}
	m2, err = c.importMem(fresh)
	if err != nil {
		t.Fatal(err)
	}
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
	c := newTestCache(f)
	r := remoteRegion(f.devs[0].uuid, 6, 7)
	m, err := c.importMem(r)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error)
	go func() { done <- m.Close() }()
	time.Sleep(5 * time.Millisecond)
	r2 := r
	r2.BufferID = 9 // even for another allocation: it must not get the dying mapping
	m2, err := c.importMem(r2)
	if err != nil {
		t.Fatal(err)
	}
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
	if !errors.Is(err, ErrOtherPIDNamespace) || !strings.Contains(err.Error(), "VMM POSIX-fd") || !strings.Contains(err.Error(), "store daemon") {
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
	b := &Buffer{dev: dev, ptr: 0x5000_0000_0000, size: 1 << 20, bufferID: 42}
	registerBuffer(b)
	defer unregisterBuffer(b.ptr, b)
	r := remoteRegion(dev.uuid, 10, 42)
	r.ExporterPID, r.ExporterBase, r.AllocSize, r.Offset, r.Size = testSelf.PID, b.ptr, b.size, 4096, 8192
	m, err := c.importMem(r)
	if err != nil {
		t.Fatal(err)
	}
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
		m, err := c.importMem(remoteRegion(f.devs[0].uuid, 11, 7))
		if err != nil {
			t.Fatal(err)
		}
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
