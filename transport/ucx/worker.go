package ucx

import (
	"context"
	"errors"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	raw "github.com/cudaipc/cudaipc/internal/ucx"
	"golang.org/x/sys/unix"
)

// WorkerOptions are the settings of Context.NewWorker.
type WorkerOptions struct {
	// Name names the worker in UCX's logs; empty leaves UCX's default.
	Name string
}

// Worker is a UCP worker (ucp_worker_h): the progress engine that
// endpoints, transfers and the serving of this process's registered memory
// run on. UCX workers are not thread-safe; this one is created in
// UCS_THREAD_MODE_SERIALIZED and every call on it, its endpoints and its
// keys takes the worker's lock, so all methods may be called from any
// goroutine. A worker whose memory peers read over transports that emulate
// GET with messages (tcp, shared memory) must be progressed: run Serve in a
// goroutine, or keep calling Get on it.
type Worker struct {
	ctx *Context

	mu        sync.Mutex // serializes every UCX call on h and its endpoints
	h         raw.Worker
	closed    bool
	efd       int
	addr      WorkerAddress
	endpoints map[*Endpoint]struct{}
	parked    []*Endpoint // closed endpoints whose UCX endpoints are kept (Endpoint.Close), oldest first
	serving   bool
	served    chan struct{} // closed when Serve returns; nil when not serving
	gets      int           // Gets and Fetches running on the worker's endpoints
	fetchSeq  uint64        // the last Fetch reply tag's sequence number
	// sns counts the UCX endpoints w created to each peer address
	// (nextSNLocked): what UCX pairs them by. Like UCX's own count, it
	// lasts as long as the worker.
	sns   map[string]int
	fetch *fetchServer // answers fetch requests while Serve runs

	// Drains of replies to canceled fetches (fetchDrain), their shared
	// buffer, and how many completed with a reply and without one.
	drains                    []fetchDrain
	drainBuf                  []byte
	drainsDone, drainsDropped uint64

	readied atomic.Bool // a window's bytes became ready since Serve last looked
	// sleeping is set while Serve sleeps on the event descriptor (from
	// just before its last look at readied): only then does wakeServe
	// signal the worker.
	sleeping atomic.Bool
	// sig guards gone, set before the worker is destroyed: wakeServe
	// signals under sig rather than mu, which a spinning Serve holds.
	sig  sync.Mutex
	gone bool
}

// NewWorker creates a worker (ucp_worker_create) and fetches its address.
func (c *Context) NewWorker(o WorkerOptions) (*Worker, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil, ErrClosed
	}
	p := &raw.WorkerParams{
		FieldMask:  raw.WorkerParamFieldThreadMode | raw.WorkerParamFieldEvents,
		ThreadMode: raw.ThreadModeSerialized,
		Events:     raw.WakeupRMA | raw.WakeupRX | raw.WakeupTX,
	}
	if o.Name != "" {
		p.FieldMask |= raw.WorkerParamFieldName
		p.Name = cString(o.Name)
	}
	h, err := raw.WorkerCreate(c.h, p)
	if err != nil {
		return nil, err
	}
	a, n, err := raw.WorkerGetAddress(h)
	if err != nil {
		raw.WorkerDestroy(h)
		return nil, err
	}
	b := raw.CopyAddress(a, n)
	raw.WorkerReleaseAddress(h, a)
	efd, err := raw.WorkerGetEfd(h)
	if err != nil {
		raw.WorkerDestroy(h)
		return nil, err
	}
	major, minor, _, _ := raw.GetVersion()
	w := &Worker{
		ctx:       c,
		h:         h,
		efd:       efd,
		addr:      WorkerAddress{ucxMajor: uint8(major), ucxMinor: uint8(minor), b: b},
		endpoints: map[*Endpoint]struct{}{},
	}
	c.workers[w] = struct{}{}
	c.workersChangedLocked()
	c.handles.add(h, 0)
	return w, nil
}

// Address returns the worker's address, which a peer passes to
// Worker.Connect to reach it.
func (w *Worker) Address() WorkerAddress { return w.addr }

// Progress runs ucp_worker_progress once and returns how many events it
// handled.
func (w *Worker) Progress() (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		return 0, ErrClosed
	}
	return int(w.progressLocked()), nil
}

// serveSpin is how long Serve keeps polling after the last event before it
// sleeps on the worker's event descriptor: a stream of requests (a
// transfer in chunks, back-to-back small reads) is served at polling
// latency, an idle worker costs no CPU.
const serveSpin = 200 * time.Microsecond

// serveSleep bounds one sleep of Serve, so that events of a transport that
// cannot wake the descriptor are still handled.
const serveSleep = 100 * time.Millisecond

// deferredSleep bounds one sleep of Serve while fetches wait for bytes not
// ready yet.
const deferredSleep = 10 * time.Millisecond

// Serve progresses the worker until ctx is done or the worker is closed,
// and returns nil then. While it runs, the worker answers peers' Fetch
// requests for bytes of the regions its Context has registered. It runs on a locked OS thread, polls while there is
// work and sleeps on the worker's event descriptor (ucp_worker_arm) when
// idle. One Serve runs per worker at a time; a second returns an error.
func (w *Worker) Serve(ctx context.Context) error {
	w.mu.Lock()
	switch {
	case w.closed:
		w.mu.Unlock()
		return ErrClosed
	case w.serving:
		w.mu.Unlock()
		return errors.New("ucx: the worker is already served")
	}
	w.serving = true
	done := make(chan struct{})
	w.served = done
	w.fetch = newFetchServer(w)
	w.mu.Unlock()
	defer close(done)
	defer func() {
		w.mu.Lock()
		w.fetch.stopLocked()
		w.fetch = nil
		w.serving = false
		w.mu.Unlock()
	}()

	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	stop := context.AfterFunc(ctx, w.wake)
	defer stop()

	fds := []unix.PollFd{{Fd: int32(w.efd), Events: unix.POLLIN}}
	last := time.Now()
	for {
		w.mu.Lock()
		if w.closed || ctx.Err() != nil {
			w.mu.Unlock()
			return nil
		}
		n := int(w.progressLocked())
		n += w.fetch.pollLocked(n > 0)
		w.mu.Unlock()
		if n > 0 {
			last = time.Now()
			continue
		}
		if time.Since(last) < serveSpin {
			continue
		}
		w.mu.Lock()
		if w.closed {
			w.mu.Unlock()
			return nil
		}
		// A last look at every fetch request and reply before sleeping
		// (a receive posted for a request already waiting completes
		// without waking the event descriptor).
		if w.fetch.pollLocked(true) > 0 || w.fetch.again {
			w.mu.Unlock()
			last = time.Now()
			continue
		}
		err := raw.WorkerArm(w.h)
		sleep := serveSleep
		if len(w.fetch.deferred) > 0 {
			sleep = deferredSleep // to refuse those waiting DeferWait in time
		}
		w.mu.Unlock()
		if errors.Is(err, raw.ErrBusy) {
			last = time.Now()
			continue
		}
		if err != nil {
			return err
		}
		// Bytes made ready before the arm (whose signal the arm may have
		// taken) are answered without sleeping. sleeping is set first: a
		// wakeServe after this look at readied sees it and signals.
		w.sleeping.Store(true)
		if w.readied.Swap(false) {
			w.sleeping.Store(false)
			last = time.Now()
			continue
		}
		_, err = unix.Poll(fds, int(sleep/time.Millisecond))
		w.sleeping.Store(false)
		if err != nil && !errors.Is(err, unix.EINTR) {
			return err
		}
		last = time.Now()
	}
}

// Serving reports whether a Serve is running on the worker.
func (w *Worker) Serving() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.serving
}

// wake makes a sleeping Serve return to its loop (ucp_worker_signal).
// wakeServe wakes a Serve of w to answer fetches waiting for bytes that
// became ready (Window.Ready); readied tells a Serve about to sleep. A
// Serve that is not sleeping retries its waiting fetches on every turn of
// its loop: it is not signaled, and w.mu, which it holds most of the
// time, is not taken (ucp_worker_signal may be called from any thread).
func (w *Worker) wakeServe() {
	w.readied.Store(true)
	if !w.sleeping.Load() {
		return
	}
	w.sig.Lock()
	defer w.sig.Unlock()
	if !w.gone {
		_ = raw.WorkerSignal(w.h)
	}
}

func (w *Worker) wake() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.closed {
		_ = raw.WorkerSignal(w.h)
	}
}

// Close stops Serve, closes the worker's endpoints (forcibly: requests in
// flight fail with UCS_ERR_CANCELED) and destroys the worker. It is
// idempotent.
func (w *Worker) Close() error {
	w.mu.Lock()
	if w.closed {
		w.mu.Unlock()
		return nil
	}
	eps := make([]*Endpoint, 0, len(w.endpoints))
	for e := range w.endpoints {
		eps = append(eps, e)
	}
	w.mu.Unlock()
	var errs []error
	for _, e := range eps {
		errs = append(errs, e.close(true))
	}
	// Gets on the closed endpoints end once UCX has completed their
	// requests (they progress the worker for it); destroying the worker
	// before would leave those requests unreleased.
	for deadline := time.Now().Add(purgeWait + time.Second); ; time.Sleep(time.Millisecond) {
		w.mu.Lock()
		n := w.gets
		w.mu.Unlock()
		if n == 0 || time.Now().After(deadline) {
			break
		}
	}
	w.mu.Lock()
	w.closed = true
	served := w.served
	if w.serving {
		_ = raw.WorkerSignal(w.h)
	}
	w.mu.Unlock()
	if served != nil {
		<-served
	}
	w.mu.Lock()
	w.sweepParkedLocked() // all: w.closed
	w.closeDrainsLocked()
	w.ctx.handles.remove(w.h, 0)
	w.sig.Lock()
	w.gone = true
	w.sig.Unlock()
	raw.WorkerDestroy(w.h)
	if w.drainBuf != nil {
		_ = unix.Munmap(w.drainBuf)
		w.drainBuf = nil
	}
	w.mu.Unlock()
	w.ctx.mu.Lock()
	delete(w.ctx.workers, w)
	w.ctx.workersChangedLocked()
	w.ctx.mu.Unlock()
	return errors.Join(errs...)
}

// closeDrainsLocked ends the worker's drains before it is destroyed: it
// cancels them, waits up to closeWait for those a reply already matched,
// and gives the rest back to UCX; w.mu is held.
func (w *Worker) closeDrainsLocked() {
	w.cancelDrainsLocked(nil)
	for deadline := time.Now().Add(closeWait); len(w.drains) > 0 && time.Now().Before(deadline); {
		raw.WorkerProgress(w.h)
		w.reapDrainsLocked()
	}
	for _, d := range w.drains {
		raw.RequestFree(d.req)
	}
	w.drains = nil
}
