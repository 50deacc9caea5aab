package ucx

import (
	"errors"
	"runtime"
	"time"

	raw "github.com/cudaipc/cudaipc/internal/ucx"
)

// LeakedContexts is how many Contexts the cleanup backstop released.
func LeakedContexts() int64 { return leakedContexts.Load() }

// MakeWorkerAddress is a WorkerAddress of raw bytes b, as UCX 1.16 made.
func MakeWorkerAddress(b []byte) WorkerAddress { return WorkerAddress{ucxMajor: 1, ucxMinor: 16, b: b} }

// MakeFetchRequest encodes a fetch request.
func MakeFetchRequest(replyTag, addr, n uint64, token Token, reader WorkerAddress) []byte {
	return fetchRequest{replyTag: replyTag, addr: addr, n: n, token: token, reader: reader}.marshal()
}

// ParseFetchRequest decodes b as a fetch request and re-encodes it.
func ParseFetchRequest(b []byte) ([]byte, error) {
	r, err := parseFetchRequest(b)
	if err != nil {
		return nil, err
	}
	return r.marshal(), nil
}

// FetchDrains returns how many drains of replies to canceled fetches the
// worker has pending, and how many completed with a reply and without one.
func (w *Worker) FetchDrains() (pending int, done, dropped uint64) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.drains), w.drainsDone, w.drainsDropped
}

// FetchRequests is how many fetch requests the worker has posted.
func (w *Worker) FetchRequests() uint64 {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.fetchSeq
}

// PendingFetchReplies is how many fetch replies the worker's Serve has
// under way (0 when it is not serving).
func (w *Worker) PendingFetchReplies() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.fetch == nil {
		return 0
	}
	return len(w.fetch.sends)
}

// Hold takes the worker's lock, which stops Serve and every read on it
// from progressing it, and returns the function that releases it.
func (w *Worker) Hold() (release func()) {
	w.mu.Lock()
	return w.mu.Unlock
}

// ForceClose closes the endpoint forcibly, as Close does one that failed.
func (e *Endpoint) ForceClose() error { return e.close(true) }

// ReplyTag and ReplySN expose the fetch reply tags' layout.
func ReplyTag(seq uint64, sn int) uint64 { return replyTag(seq, sn) }

// ReplySN is the connection sequence number a reply tag carries, or -1.
func ReplySN(tag uint64) int { return replySN(tag) }

// FetchPeers is how many endpoints back to readers the serving worker
// keeps.
func (w *Worker) FetchPeers() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.fetch == nil {
		return 0
	}
	return len(w.fetch.peers)
}

// SendFetchRequest sends msg as a fetch request on e, as a hostile reader
// could, and waits until UCX has sent it.
func (e *Endpoint) SendFetchRequest(msg []byte) error {
	w := e.w
	w.mu.Lock()
	defer w.mu.Unlock()
	var pin runtime.Pinner
	pin.Pin(&msg[0])
	defer pin.Unpin()
	req, err := raw.TagSendNbx(e.h, raw.Addr(msg), uint64(len(msg)), fetchRequestTag, &raw.RequestParam{})
	if err != nil || req == 0 {
		return err
	}
	defer raw.RequestFree(req)
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); {
		raw.WorkerProgress(w.h)
		if s := raw.RequestCheckStatus(req); s != raw.InProgress {
			if s != raw.OK {
				return &raw.Error{Func: "ucp_tag_send_nbx", Status: s}
			}
			return nil
		}
	}
	return errors.New("the request was not sent within 10 s")
}
