package node

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/cluster/staging"
	"github.com/cudaipc/cudaipc/cluster/ucxtransport"
	"github.com/cudaipc/cudaipc/store"
)

// A GPU object published before it is staged. Where the device computes
// the chunk checksums (milliseconds for gigabytes) and this node answers
// only fetches, the seal publishes the record as soon as it has them and
// stages the object device→host into a pinned buffer behind it, a slice
// at a time. Readers that come meanwhile are exposed the buffer through a
// filling window (ucx.MemRegion.FillingWindow): their fetches of bytes not
// staged yet wait at this node and are answered as each slice lands, so
// the first chunks cross the wire while the last ones are still copied
// out. A node that answers GETs stages first (GETs would read bytes not
// staged yet).

// filling is a GPU object's pinned copy being staged after its record.
type filling struct {
	n    *Node
	id   string
	b    *pinned
	size int64
	done chan struct{} // closed when the staging ended

	mu      sync.Mutex
	staged  int64 // bytes staged so far
	ended   bool
	err     error                    // the staging's failure
	windows map[*fillWindow]struct{} // exposures' windows, opened as slices land
	users   int                      // the staging and each exposure: the buffer goes back with the last
}

type fillWindow struct {
	ready func(k int64)
	close func()
}

// fillsAfterPublish reports whether a GPU object of dev is published
// before it is staged: the device computes its checksums, UCX does not
// register GPU memory (exposures read a staged copy), and this node
// answers no GETs; and Config.StageFirst is not set.
func (n *Node) fillsAfterPublish(dev *cudaipc.Device) bool {
	return !n.cfg.StageFirst && n.cfg.Read != ucxtransport.ReadGet && !n.tr.CanRegisterCUDA() && n.deviceSums(dev)
}

// errNoDeviceSums: the device could not checksum a GPU object; its seal
// stages it and checksums it on the host instead (gpuChecksums).
var errNoDeviceSums = errors.New("the device could not checksum the object")

// gpuFilling has the device compute the chunk checksums of the GPU object
// of f, incarnation id, then starts staging it into a pinned buffer
// registered with UCX and returns the checksums, for the caller to
// publish while the staging goes on. The checksums come first: the kernel
// runs much slower beside the device→host copy, and readers come only once
// the record is out.
// started reports whether the staging began: it then releases f when it
// ends, whatever gpuFilling returns. errNoDeviceSums means the caller must
// seal the object the other way.
func (n *Node) gpuFilling(ctx context.Context, f *store.ClusterFile, chunk int64, id string) (sums []uint32, started bool, err error) {
	dev, src, size := f.GPU.Device, f.GPU.Ptr, f.Size
	b, err := n.pinned.get(dev, size)
	if err != nil {
		return nil, false, err
	}
	if err := n.registerPinned(b); err != nil {
		n.pinned.put(b)
		return nil, false, err
	}
	if sums, err = dev.ChunkCRC32C(src, size, chunk); err != nil {
		n.pinned.put(b)
		n.log.Warn("the device failed to checksum a GPU object: the host checksums it", "device", dev.String(), "err", err)
		return nil, false, errNoDeviceSums
	}
	n.deviceSummed.Add(uint64(size))
	fl := &filling{n: n, id: id, b: b, size: size, done: make(chan struct{}), windows: map[*fillWindow]struct{}{}, users: 1}
	n.mu.Lock()
	n.filling[id] = fl
	n.mu.Unlock()
	go func() {
		defer f.Release()
		begin := time.Now()
		t, err := n.stageQueued(dev, b.mem[:size], src, func(off int64) error {
			if h := n.stageHook.Load(); h != nil {
				return (*h)(off)
			}
			return nil
		}, fl.advance)
		n.log.Debug("staged a published GPU object", "id", id, "bytes", size, "took", time.Since(begin),
			"copying", t.copying, "idle", t.idle, "err", err)
		fl.end(err)
	}()
	return sums, true, nil
}

// stageDepth is how many slices of a filling's staging are queued on the
// device at once: the copy engine goes on with the next ones while the
// staging goroutine waits for a CPU, and the landing of each is said as
// soon as it lands (Window.Ready, which takes no lock of the served
// workers, so the stream is not left idle beside a pull: stageTimes says).
const stageDepth = 4

// stageTimes is how a staging spent the device's time, from timing events
// around each slice's copy: copying, the copies' own time; idle, the time
// the stream sat empty between a slice's end and the next one's start (the
// staging goroutine or the scheduler late to queue it). Their sum is about
// the staging's wall time: a slow staging with little idle time has slow
// copies, not a late goroutine.
type stageTimes struct{ copying, idle time.Duration }

// stageQueued copies dst's len(dst) bytes from src on dev into dst
// (pinned), DefaultSealSlice bytes a slice, stageDepth slices queued at a
// time on a stream of its own (staging.CopyOutQueued); before queueing the
// slice at off it calls before(off), whose error stops the copy, and as
// the first k bytes land, landed(k). It returns how the device's time went.
func (n *Node) stageQueued(dev *cudaipc.Device, dst []byte, src cudaipc.DevicePtr, before func(off int64) error, landed func(k int64)) (t stageTimes, err error) {
	st, err := dev.NewStream()
	if err != nil {
		return t, err
	}
	defer func() {
		st.Synchronize() // a copy queued when a later step failed lands before dst goes back
		st.Close()
	}()
	// Two events a slice (its copy's start and end), in a ring twice the
	// queue's depth: slice k's events are recorded again only by slice
	// k+2*stageDepth, queued after slice k+stageDepth was waited for, so the
	// waiter of slice k+1 still reads slice k's end.
	var begins, ends [2 * stageDepth]*cudaipc.Event
	for i := range begins {
		if begins[i], err = dev.NewEvent(cudaipc.EventBlockingSync); err != nil {
			break
		}
		if ends[i], err = dev.NewEvent(cudaipc.EventBlockingSync); err != nil {
			break
		}
	}
	defer func() {
		for _, e := range append(begins[:], ends[:]...) {
			if e != nil {
				e.Close()
			}
		}
	}()
	if err != nil {
		return t, err
	}
	queued, waited := 0, 0
	err = staging.CopyOutQueued(context.Background(), dst, 0, stageDepth, func(off int64, b []byte) (func() error, error) {
		if err := before(off); err != nil {
			return nil, err
		}
		k := queued % len(begins)
		if err := begins[k].Record(st); err != nil {
			return nil, err
		}
		if err := st.CopyFromDeviceAsync(b, src+cudaipc.DevicePtr(off)); err != nil {
			return nil, err
		}
		if err := ends[k].Record(st); err != nil {
			return nil, err
		}
		queued++
		return func() error { // the waiter's, in order of the slices
			i := waited
			waited++
			k := i % len(begins)
			if err := ends[k].Synchronize(); err != nil {
				return err
			}
			// Timing is diagnostics: an error of Elapsed costs the numbers, not the staging.
			if d, err := ends[k].Elapsed(begins[k]); err == nil {
				t.copying += d
			}
			if i > 0 {
				if d, err := begins[k].Elapsed(ends[(i-1)%len(ends)]); err == nil {
					t.idle += d
				}
			}
			return nil
		}, nil
	}, landed)
	return t, err
}

// advance says that the first k bytes are staged.
func (fl *filling) advance(k int64) {
	fl.mu.Lock()
	fl.staged = k
	ws := slices.Collect(maps.Keys(fl.windows))
	fl.mu.Unlock()
	for _, w := range ws {
		w.ready(k)
	}
}

// end ends the staging: on a failure the exposures' windows close (their
// readers' waiting fetches are refused and their pulls fail); later
// exposures stage the object anew.
func (fl *filling) end(err error) {
	fl.mu.Lock()
	fl.ended, fl.err = true, err
	var closes []func()
	if err != nil {
		for w := range fl.windows {
			closes = append(closes, w.close)
		}
	}
	fl.mu.Unlock()
	for _, c := range closes {
		c()
	}
	if err != nil {
		fl.n.log.Warn("staging a published GPU object failed: its readers fail and later ones stage it again", "id", fl.id, "err", err)
	} else {
		fl.n.stagedBytes.Add(uint64(fl.size))
	}
	fl.n.mu.Lock()
	delete(fl.n.filling, fl.id)
	fl.n.mu.Unlock()
	close(fl.done)
	fl.drop()
}

// drop ends one use of the buffer; the last gives it back, tagged with
// the incarnation when it holds all of it.
func (fl *filling) drop() {
	fl.mu.Lock()
	fl.users--
	last, whole := fl.users == 0, fl.ended && fl.err == nil
	fl.mu.Unlock()
	if !last {
		return
	}
	fl.b.tag = ""
	if whole {
		fl.b.tag = fl.id
	}
	fl.n.pinned.put(fl.b)
}

// fillingFor returns the filling of incarnation id, with a use taken for
// an exposure, or nil when it is not being staged.
func (n *Node) fillingFor(id string) *filling {
	n.mu.Lock()
	defer n.mu.Unlock()
	fl := n.filling[id]
	if fl != nil {
		fl.mu.Lock()
		fl.users++
		fl.mu.Unlock()
	}
	return fl
}

// exposeFilling exposes fl's buffer through a filling window, ready as
// far as it is staged and advancing with the staging; release ends the
// exposure. It owns the use fillingFor took.
func (n *Node) exposeFilling(fl *filling) (cluster.Exposure, func(), error) {
	fw, err := fl.b.reg.FillingWindow(0, fl.size)
	if err != nil {
		fl.drop()
		return cluster.Exposure{}, nil, err
	}
	w := &fillWindow{ready: fw.Ready, close: fw.Close}
	fl.mu.Lock()
	if fl.err != nil {
		err := fl.err
		fl.mu.Unlock()
		fw.Close()
		fl.drop()
		return cluster.Exposure{}, nil, fmt.Errorf("stage a GPU object device→host: %w", err)
	}
	fw.Ready(fl.staged)
	fl.windows[w] = struct{}{}
	fl.mu.Unlock()
	n.exposures.Add(1)
	n.exposedBytes.Add(uint64(fl.size))
	e := cluster.Exposure{Worker: n.tr.WorkerAddress(), RKey: fw.Key, Addr: fl.b.reg.Addr(0), Size: fl.size}
	return e, func() {
		fw.Close()
		fl.mu.Lock()
		delete(fl.windows, w)
		fl.mu.Unlock()
		fl.drop()
	}, nil
}
