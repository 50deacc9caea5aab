package store

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"time"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/bundle"
	"github.com/cudaipc/cudaipc/protocol"
	"github.com/cudaipc/cudaipc/protocol/storev1"
)

// No-copy versions (docs/protocol.md section 6.8): a version of a bundle
// whose bytes are memory its publisher holds (a trainer's own tensors),
// one registered region per CUDA allocation, rather than an arena of the
// store. It is an object like any other shard of a version (one
// lifecycle: create, seal, lease, release, retire); what differs is data:
// its bytes are a sources table and its descriptors, kept as register
// keeps them. The daemon never maps that memory and counts none of it
// against capacity.
//
// Lifetimes. While readers copy, the publisher must not change its
// tensors: withdraw (the next no-copy publish, or the publisher's
// wait_released) stops new leases of its no-copy versions and answers once
// the last one ended. A publisher that disconnects withdraws the versions
// with a cuda-ipc region at once (legacy IPC is valid only while its
// exporter lives; readers' open mappings stay valid); versions of VMM
// memory alone are orphaned: readable while leased, since a descriptor
// keeps its memory alive, and freed with their last lease.

// sources is the bytes of a no-copy version. Guarded by Store.mu once the
// object is sealed.
type sources struct {
	device   string     // the GPU's UUID, as cudaipc.UUID.String prints it
	files    []*os.File // one per piece of the table's vmm-fd regions, in order; nil once closed
	legacy   bool       // some region is cuda-ipc: valid only while the publisher lives
	regions  int
	orphaned bool // its publisher disconnected
	// charged is the store its descriptors are charged to (budget.go),
	// owner the uid; nil until charged, which happens under Store.mu once
	// the create succeeds: close must then run under it too.
	charged *Store
	owner   uint32
	counted bool // counted against the owner's objects (budget.go) until freed
}

// creatorOf reports whether ss created o and is still connected.
func (o *object) creatorOf(ss *session) bool { return o.creator == ss }

func (src *sources) close() {
	if src == nil {
		return
	}
	for _, f := range src.files {
		f.Close()
	}
	if src.charged != nil {
		src.charged.giveFDsLocked(src.owner, len(src.files))
		src.charged = nil
	}
	src.files = nil
}

// check decodes a sealed sources table and checks it against the object
// it describes: every region valid and on the object's GPU, one
// descriptor per vmm-fd piece, and the regions laid end to end spanning
// exactly size bytes.
func (src *sources) check(table []byte, size int64, checked *sourcesCache) error {
	if legacy, n, ok := checked.lookup(table, size, src.device, len(src.files)); ok {
		src.legacy, src.regions = legacy, n
		return nil
	}
	entries, err := bundle.DecodeSources(table)
	if err != nil {
		return invalidf("%v", err)
	}
	sizes := make([]int64, len(entries))
	pieces := 0
	legacy := false
	for i, b := range entries {
		r, err := cudaipc.DecodeRegion(b)
		if err != nil {
			return invalidf("sources table: region %d: %v", i, err)
		}
		if r.Device.String() != src.device {
			return invalidf("sources table: region %d is on %s, the version on %s", i, r.Device, src.device)
		}
		switch r.Kind {
		case cudaipc.KindCUDAIPC:
			legacy = true
		case cudaipc.KindVMMFD:
			pieces += len(r.Pieces())
		default:
			return invalidf("sources table: region %d is of kind %s: want cuda-ipc or vmm-fd", i, r.Kind)
		}
		sizes[i] = r.Size
	}
	if pieces != len(src.files) {
		return invalidf("sources table: its vmm-fd regions have %d pieces, the create carried %d descriptors: send one per piece, in table order", pieces, len(src.files))
	}
	_, span, err := bundle.SourceStarts(sizes)
	if err != nil {
		return invalidf("%v", err)
	}
	if span != size {
		return invalidf("sources table: its %d regions span %d bytes, the version is %d", len(entries), span, size)
	}
	src.legacy, src.regions = legacy, len(entries)
	checked.add(table, size, src.device, len(src.files), legacy, len(entries))
	return nil
}

// sourcesCache remembers the last sources tables that passed the check, as
// manifestCache does manifests: a publisher's next version over the same
// allocations sends the same table, and decoding thousands of regions lies
// between its publish and its readers. The same bytes checked against the
// same size, device and descriptor count give the same verdict.
type sourcesCache struct {
	mu      sync.Mutex
	entries []checkedSources // newest last
}

type checkedSources struct {
	table          []byte
	size           int64
	device         string
	files, regions int
	legacy         bool
}

const sourcesCacheEntries = 4

func (c *sourcesCache) lookup(table []byte, size int64, device string, files int) (legacy bool, regions int, ok bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for i := len(c.entries) - 1; i >= 0; i-- {
		e := c.entries[i]
		if e.size == size && e.device == device && e.files == files && bytes.Equal(e.table, table) {
			return e.legacy, e.regions, true
		}
	}
	return false, 0, false
}

func (c *sourcesCache) add(table []byte, size int64, device string, files int, legacy bool, regions int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.entries = append(c.entries, checkedSources{table: table, size: size, device: device, files: files, regions: regions, legacy: legacy})
	if len(c.entries) > sourcesCacheEntries {
		c.entries[0] = checkedSources{}
		c.entries = c.entries[1:]
	}
}

// newSources starts the bytes of a no-copy create; it takes files.
func newSources(r createReq) (*sources, error) {
	if !r.versioned || r.manifestSize == 0 {
		protocol.CloseFiles(r.files)
		return nil, invalidf("a sources table is for a version of a bundle: set versioned and manifest_size")
	}
	if len(r.files) != int(r.nfiles) {
		protocol.CloseFiles(r.files)
		return nil, invalidf("create: the request says %d descriptors; %d were staged and attached", r.nfiles, len(r.files))
	}
	u, err := cudaipc.ParseUUID(r.device)
	if err != nil {
		protocol.CloseFiles(r.files)
		return nil, invalidf("no-copy version: device %q: its memory is named by its GPU's UUID (GPU-…): %v", r.device, err)
	}
	return &sources{device: u.String(), files: r.files}, nil
}

// republishable is what a republish (CreateRequest.like_version) of a
// session's last sealed no-copy version of a name shares, kept by the
// session (session.republish) beyond that version's own life, which a
// withdraw ends: the version's number, its sealed manifest (a descriptor
// of its own, charged to the uid) and what the version's check found.
type republishable struct {
	version uint64
	man     *manifest
	device  string
	size    int64
	legacy  bool
	regions int
}

// rememberLocked keeps sealed no-copy version o of this session for a
// republish, in place of the one before; only versions of cuda-ipc
// regions alone (no descriptors) are kept. One that the uid's descriptor
// budget has no room for is not kept (its republish is refused: the
// client sends the version afresh).
func (ss *session) rememberLocked(o *object) {
	s := ss.s
	if o.src == nil || o.ver == nil || o.manifest == nil || !o.manifest.sealed || len(o.src.files) != 0 {
		return
	}
	ss.forgetRepublishLocked(o.name)
	if s.takeFDsLocked(ss.peer.uid, 1) != nil {
		return
	}
	f, err := o.manifest.dup()
	if err != nil {
		s.giveFDsLocked(ss.peer.uid, 1)
		return
	}
	man := &manifest{f: f, size: o.manifest.size, sources: o.manifest.sources, tensors: o.manifest.tensors, sealed: true,
		charged: s, owner: ss.peer.uid}
	if ss.republish == nil {
		ss.republish = make(map[string]*republishable)
	}
	ss.republish[o.name] = &republishable{version: o.ver.n, man: man, device: o.src.device, size: o.size,
		legacy: o.src.legacy, regions: o.src.regions}
}

// forgetRepublishLocked lets go of what rememberLocked kept for name.
func (ss *session) forgetRepublishLocked(name string) {
	if rp := ss.republish[name]; rp != nil {
		rp.man.close()
		delete(ss.republish, name)
	}
}

// likeLocked is a republish's manifest (CreateRequest.like_version): a
// share of the sealed memfd of version r.like of r.name, which must be the
// last no-copy version of cuda-ipc regions this session sealed under the
// name, of the create's device, size and manifest and table sizes. src
// takes what that version's check found. Those bytes were checked and can
// no longer change (F_SEAL_WRITE), so the new version is checked by this.
func (ss *session) likeLocked(r createReq, src *sources) (*manifest, error) {
	rp := ss.republish[r.name]
	switch {
	case rp == nil || rp.version != r.like:
		return nil, fmt.Errorf("like_version %d of %q: not the last no-copy version of cuda-ipc regions this connection sealed under the name: %w", r.like, r.name, ErrNotFound)
	case rp.device != src.device || rp.size != r.size || rp.man.size != r.manifestSize || rp.man.sources != r.sourcesSize:
		return nil, invalidf("like_version %d of %q: its device, size or manifest size differ from this create's", r.like, r.name)
	}
	f, err := rp.man.dup()
	if err != nil {
		return nil, err
	}
	src.legacy, src.regions = rp.legacy, rp.regions
	return &manifest{f: f, size: rp.man.size, sources: rp.man.sources, tensors: rp.man.tensors, sealed: true}, nil
}

// placeSourcesLocked describes where a no-copy version's bytes are: its
// sources table travels in the manifest's memfd; a get carries duplicates
// of its descriptors.
func (ss *session) placeSourcesLocked(o *object, writable bool) (placement, error) {
	src := o.src
	p := placement{device: src.device, size: o.size, arenaSize: o.size, writable: writable, external: true, kind: storev1.Placement_CUDA_IPC}
	if len(src.files) > 0 {
		p.kind = storev1.Placement_VMM_FD
	}
	if writable {
		return p, nil
	}
	p.files = len(src.files)
	for _, f := range src.files[:min(len(src.files), protocol.AttachedFiles(true))] {
		d, err := dupFile(f)
		if err != nil {
			p.closeShare()
			return placement{}, fmt.Errorf("duplicating a descriptor of %q: %w", o.name, err)
		}
		p.pieceFiles = append(p.pieceFiles, d)
	}
	return p, nil
}

// publisherGoneLocked handles the end of the connection that published
// the no-copy version o (sealed): see the lifetimes above.
func (s *Store) publisherGoneLocked(o *object) {
	v := o.ver
	if v == nil || v.withdrawn() {
		return
	}
	if !v.visible() {
		// No reader has it: the version goes as a shard's creator that
		// dies before sealing takes it.
		s.abortVersionLocked(v)
		return
	}
	if o.src.legacy {
		s.logFor(v.s.owner).Info("no-copy version withdrawn: its publisher disconnected (legacy IPC is valid only while it lives)", "name", v.s.name, "version", v.n, "leases", v.leases)
		s.withdrawVersionLocked(v)
		return
	}
	o.src.orphaned = true
	s.logFor(v.s.owner).Info("no-copy version orphaned: its publisher disconnected; readable while leased", "name", v.s.name, "version", v.n, "leases", v.leases)
	if v.leases == 0 {
		s.withdrawVersionLocked(v)
	}
}

// withdraw withdraws the visible no-copy versions of name this session
// published and waits, until ctx ends, for their last lease to end. It
// returns how many it withdrew; ErrTimeout names the leases and readers
// left.
func (ss *session) withdraw(ctx context.Context, name string) (int, error) {
	s := ss.s
	s.mu.Lock()
	if ss.closed {
		s.mu.Unlock()
		return 0, errSessionClosed
	}
	e := s.lookupLocked(name)
	if !e.is(kindSeries) {
		in, sees := ss.infoLocked(e)
		s.mu.Unlock()
		if sees && !in.External {
			return 0, invalidf("%q is not versioned: only versions are published without a copy", name)
		}
		return 0, nil // nothing published under it, or nothing left
	}
	sr := e.ser
	var mine []*version
	for _, v := range sr.versions {
		if o := v.shards[0]; v.visible() && o != nil && o.src != nil && o.creatorOf(ss) {
			mine = append(mine, v)
		}
	}
	for _, v := range mine {
		if !v.withdrawn() {
			s.withdrawVersionLocked(v)
		}
	}
	s.mu.Unlock()
	for {
		s.mu.Lock()
		leases, readers := 0, map[*session]bool{}
		var wait chan struct{}
		for _, v := range mine {
			if v.leases > 0 {
				leases += v.leases
				for r := range s.sessions {
					for _, l := range r.leases {
						if l.obj != nil && l.obj.ver == v {
							readers[r] = true
						}
					}
				}
				if v.released == nil {
					v.released = make(chan struct{})
				}
				wait = v.released
				break
			}
		}
		s.mu.Unlock()
		if wait == nil {
			return len(mine), nil
		}
		select {
		case <-wait:
		case <-ss.ctx.Done():
			return 0, errSessionClosed
		case <-ctx.Done():
			if !errors.Is(ctx.Err(), context.DeadlineExceeded) {
				return 0, ctx.Err()
			}
			return 0, fmt.Errorf("%w: the no-copy versions of %q are withdrawn, but %d readers still hold %d leases of them: the publisher must not change its tensors until they release (ask again to wait longer)",
				ErrTimeout, name, len(readers), leases)
		}
	}
}

// withdrawReply answers a withdraw, waiting in its own goroutine.
func (cn *conn) withdrawReply(id uint64, name string, timeoutMs int64) {
	ctx := cn.ss.ctx
	if timeoutMs >= 0 && timeoutMs <= int64(24*time.Hour/time.Millisecond)*365 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(context.WithoutCancel(ctx), time.Duration(timeoutMs)*time.Millisecond)
		defer cancel()
	}
	n, err := cn.ss.withdraw(ctx, name)
	if cn.ss.ctx.Err() != nil {
		return
	}
	if err != nil {
		cn.reply("withdraw", protocol.ErrorResponse(id, err), nil)
		return
	}
	cn.reply("withdraw", &storev1.Response{Id: id, Body: &storev1.Response_Withdraw{Withdraw: &storev1.WithdrawResponse{Versions: uint32(n)}}}, nil)
}
