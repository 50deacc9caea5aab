package store

import (
	"context"
	"errors"
	"fmt"
	"math"
	"os"
	"sync"
	"time"

	"github.com/cudaipc/cudaipc/protocol"
	"github.com/cudaipc/cudaipc/protocol/storev1"
)

// Reads of KV spaces across nodes (docs/kv.md, "Across nodes"): a client
// asks its daemon to read blocks of a space registered on another node into
// a space it registered here (kv_read). The store checks the request's
// framing and hands it to its cluster hook, which must implement
// SpaceReader; the hook leases the registered memory it reads and writes
// through LeaseRegistered.

// SpaceReader is a ClusterHook that also reads KV spaces of other nodes
// (package cluster/node implements it). A store whose hook does not
// implement it refuses kv_read.
type SpaceReader interface {
	// NodeName is this node's name in the cluster: the hello tells
	// clients, and the KV spaces they register name it.
	NodeName() string
	// ReadSpace reads r, calling progress (from one goroutine, in order)
	// each time the count of complete layers from r.First grows, but for
	// the last layer, until every layer is complete or it fails; it
	// returns once nothing writes into the destination any more, with the
	// count of layers read. Its errors wrap the protocol's sentinels (the
	// code the client gets).
	ReadSpace(ctx context.Context, r SpaceRead, progress func(layers int)) (int, error)
	// NotifySpace queues payload, from a reader of uid reader, for the
	// engine of the space whose description is space, registered on
	// another node (Replicas.Notify there). Its errors wrap the protocol's
	// sentinels.
	NotifySpace(ctx context.Context, reader uint32, space, payload []byte) error
}

// kvNotifyTimeout bounds a kv_notify's forwarding to the space's node.
const kvNotifyTimeout = 10 * time.Second

// kvNotify serves a kv_notify (valid as protocol.ValidateRequest checks
// it), in a goroutine of its own: the notice goes to the space's node.
func (cn *conn) kvNotify(id uint64, r *storev1.KvNotifyRequest) {
	sr, ok := cn.s.cfg.Cluster.(SpaceReader)
	if !ok {
		cn.reply("kv_notify", protocol.ErrorResponse(id, protocol.Errorf(storev1.Error_INVALID,
			"kv_notify: this daemon is not part of a cluster: a KV space of another node cannot be notified through it")), nil)
		return
	}
	ctx, cancel := context.WithTimeout(cn.ss.ctx, kvNotifyTimeout)
	defer cancel()
	if err := sr.NotifySpace(ctx, cn.ss.peer.uid, r.GetSpace(), r.GetPayload()); err != nil {
		if cn.ss.ctx.Err() == nil {
			cn.reply("kv_notify", protocol.ErrorResponse(id, err), nil)
		}
		return
	}
	cn.reply("kv_notify", &storev1.Response{Id: id, Body: &storev1.Response_KvNotify{KvNotify: &storev1.KvNotifyResponse{}}}, nil)
}

// SpaceRead is a kv_read as the store hands it to its SpaceReader: Reader
// is the uid of the client that asked, the rest is the request's.
type SpaceRead struct {
	Reader               uint32
	Src, Dst             []byte
	SrcBlocks, DstBlocks []uint32
	First, Count         int
}

// MaxKVReads bounds the kv_reads one connection has under way.
const MaxKVReads = 1024

// kvReads are a connection's kv_reads under way, by request id.
type kvReads struct {
	mu     sync.Mutex
	cancel map[uint64]context.CancelFunc
}

// nodeName is the node name the hello tells clients: the cluster's, or "".
func (s *Store) nodeName() string {
	if sr, ok := s.cfg.Cluster.(SpaceReader); ok {
		return sr.NodeName()
	}
	return ""
}

// kvRead serves a kv_read (valid as protocol.ValidateRequest checks it) in
// a goroutine of its own: progress responses as layers complete (not the
// last: the end says it), then the end, all under the request's id.
func (cn *conn) kvRead(id uint64, r *storev1.KvReadRequest) {
	sr, ok := cn.s.cfg.Cluster.(SpaceReader)
	if !ok {
		cn.reply("kv_read", protocol.ErrorResponse(id, protocol.Errorf(storev1.Error_INVALID,
			"kv_read: this daemon is not part of a cluster: a KV space of another node cannot be read through it")), nil)
		return
	}
	ctx, cancel := context.WithCancel(cn.ss.ctx)
	if ms := r.GetTimeoutMs(); ms > 0 && ms <= math.MaxInt64/int64(time.Millisecond) {
		ctx, cancel = context.WithTimeout(cn.ss.ctx, time.Duration(ms)*time.Millisecond)
	}
	k := &cn.kv
	k.mu.Lock()
	_, dup := k.cancel[id]
	full := len(k.cancel) >= MaxKVReads
	if !dup && !full {
		if k.cancel == nil {
			k.cancel = map[uint64]context.CancelFunc{}
		}
		k.cancel[id] = cancel
	}
	k.mu.Unlock()
	switch {
	case dup:
		cancel()
		cn.reply("kv_read", protocol.ErrorResponse(id, protocol.Errorf(storev1.Error_INVALID, "kv_read: request id %d is a read under way", id)), nil)
		return
	case full:
		cancel()
		cn.reply("kv_read", protocol.ErrorResponse(id, protocol.Errorf(storev1.Error_LIMIT, "kv_read: %d reads under way on this connection, the limit", MaxKVReads)), nil)
		return
	}
	read := SpaceRead{Reader: cn.ss.peer.uid, Src: r.GetSrc(), Dst: r.GetDst(), SrcBlocks: r.GetSrcBlocks(), DstBlocks: r.GetDstBlocks(),
		First: int(r.GetFirst()), Count: int(r.GetCount())}
	cn.wg.Go(func() {
		defer func() {
			k.mu.Lock()
			delete(k.cancel, id)
			k.mu.Unlock()
			cancel()
		}()
		sent := 0
		layers, err := sr.ReadSpace(ctx, read, func(layers int) {
			if layers > sent {
				sent = layers
				cn.send(&storev1.Response{Id: id, Body: &storev1.Response_KvRead{KvRead: &storev1.KvReadResponse{Layers: uint32(layers)}}})
			}
		})
		if err != nil {
			if cn.ss.ctx.Err() != nil {
				return // the connection is gone
			}
			if ctx.Err() != nil && !errors.Is(err, ctx.Err()) {
				err = fmt.Errorf("%w: %w", ctxCode(ctx), err)
			}
			cn.reply("kv_read", protocol.ErrorResponse(id, err), nil)
			return
		}
		cn.reply("kv_read", &storev1.Response{Id: id, Body: &storev1.Response_KvRead{KvRead: &storev1.KvReadResponse{Layers: uint32(layers), Done: true}}}, nil)
	})
}

// ctxCode is the sentinel of a read that ended with its context: its
// timeout passed, or its client canceled it.
func ctxCode(ctx context.Context) error {
	if errors.Is(ctx.Err(), context.DeadlineExceeded) {
		return protocol.Errorf(storev1.Error_TIMEOUT, "kv_read: the read's timeout passed")
	}
	return protocol.Errorf(storev1.Error_TIMEOUT, "kv_read: canceled by the client")
}

// kvCancel serves a kv_cancel: the read ends with an error once its
// SpaceReader returns.
func (cn *conn) kvCancel(id uint64, r *storev1.KvCancelRequest) {
	cn.kv.mu.Lock()
	if cancel := cn.kv.cancel[r.GetReadId()]; cancel != nil {
		cancel()
	}
	cn.kv.mu.Unlock()
	cn.reply("kv_cancel", &storev1.Response{Id: id, Body: &storev1.Response_KvCancel{KvCancel: &storev1.KvCancelResponse{}}}, nil)
}

// Registration identifies one registration of registered memory: the same
// name registered again is another Registration.
type Registration struct{ e *external }

// Registered is registered memory as the cluster side of the daemon reads
// or writes it (a KV space's region): held by a lease of the store's own
// until its RegisteredLease is released.
type Registered struct {
	Registration
	// Name is the qualified name, Owner the registering uid.
	Name   string
	Owner  uint32
	Shared bool
	// Device is "host" or a GPU's UUID; Size the memory's size.
	Device string
	Size   int64
	// Space is the KV space description the memory was registered with.
	Space []byte
	// Region is GPU memory's binary region (docs/region.md); Files the
	// descriptors: host memory's memfd, or a vmm-fd region's, one per
	// piece. Duplicates: RegisteredLease.Release closes them.
	Region []byte
	Files  []*os.File
}

// RegisteredLease holds registered memory of LeaseRegistered.
type RegisteredLease struct {
	Regions []*Registered
	ss      *session
}

// Release ends the lease and closes the descriptors. It is idempotent.
func (l *RegisteredLease) Release() {
	if l.ss == nil {
		return
	}
	for _, r := range l.Regions {
		protocol.CloseFiles(r.Files)
		r.Files = nil
	}
	l.ss.close(errors.New("registered memory access done"))
	l.ss = nil
}

// LeaseRegistered leases the registered memory of each qualified name as
// uid reader may read it (its owner, root, anyone when it is shared),
// all or none: a name that is not registered memory the reader may read
// fails with ErrNotFound naming it. The memory stays registered (orphaned
// at most) until Release.
func (rp *Replicas) LeaseRegistered(reader uint32, names []string) (*RegisteredLease, error) {
	s := rp.s
	ss, err := s.newSession(context.Background(), peer{uid: reader})
	if err != nil {
		return nil, err
	}
	l := &RegisteredLease{ss: ss}
	for _, name := range names {
		r, err := ss.leaseRegistered(name)
		if err != nil {
			l.Release()
			return nil, err
		}
		l.Regions = append(l.Regions, r)
	}
	return l, nil
}

func (ss *session) leaseRegistered(name string) (*Registered, error) {
	s := ss.s
	s.mu.Lock()
	defer s.mu.Unlock()
	if ss.closed {
		return nil, errSessionClosed
	}
	_, x, err := ss.resolveLocked(name, versionSel{})
	if x == nil {
		return nil, fmt.Errorf("%q is not registered memory uid %d may read: %w", name, ss.peer.uid, ErrNotFound)
	}
	if err == nil {
		err = ss.leaseRoomLocked()
	}
	if err != nil {
		return nil, err
	}
	p, err := ss.leaseExternalLocked(x)
	if err != nil {
		return nil, err
	}
	r := &Registered{Registration: Registration{x}, Name: x.name, Owner: x.owner, Shared: x.shared, Device: x.device,
		Size: x.size, Space: x.space, Region: x.region, Files: p.pieceFiles}
	for _, f := range x.files[len(p.pieceFiles):] {
		d, err := dupFile(f)
		if err != nil {
			protocol.CloseFiles(r.Files)
			return nil, fmt.Errorf("duplicating a descriptor of %q: %w", x.name, err)
		}
		r.Files = append(r.Files, d)
	}
	return r, nil
}

// Live reports whether the registration is still registered: not deleted,
// not dropped with its registering connection's end.
func (rp *Replicas) Live(r Registration) bool {
	s := rp.s
	if r.e == nil {
		return false
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return r.e.state != extDropped
}
