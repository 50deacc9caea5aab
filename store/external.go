package store

import (
	"fmt"
	"os"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/protocol"
	"github.com/cudaipc/cudaipc/protocol/storev1"
)

// External memory: a client registers memory it owns (PyTorch, CuPy, its
// own allocator, or host memory in a memfd) under a name. The daemon keeps
// the descriptors of VMM memory and host memfds, never the memory: it does
// not map it and counts none of it against capacity. Readers get
// duplicates of the descriptors with their lease and map the memory
// themselves. docs/containers.md; a KV space's regions (docs/kv.md) are
// registered memory too.
//
// Lifetimes. A VMM descriptor or a memfd keeps its memory alive, so a
// reader's mapping outlives the registering process: when that connection
// ends the object is marked orphaned and stays readable while it is leased;
// the daemon closes its descriptors when the last lease ends (or at once if
// there is none). A legacy registration (a cuMemAlloc region) is only valid
// while its exporter lives: it is removed when the registering connection
// ends, whatever its leases.

// external is one registered object. Guarded by Store.mu.
type external struct {
	name    string
	size    int64
	device  string
	shared  bool
	owner   uint32
	created time.Time
	tensor  *storev1.TensorDesc
	space   []byte // a KV space's description, opaque (docs/kv.md)

	region []byte     // the registered binary region (docs/region.md), either kind
	files  []*os.File // vmm-fd: one per piece of region; host: the memfd; nil once dropped
	legacy []byte     // cuda-ipc: region again (the exporter must outlive its readers); nil for vmm-fd and host

	registrar *session // the registering connection, while it lives
	// state is where e is in its life (state.go): only e.to changes it.
	state  extState
	leases int
	// id names e in ArenasFreed, as an arena id would: a client keeps the
	// mapping of a lease it released through its lease table (an idle
	// lease) until the daemon reclaims it, and then drops it on this id.
	id      uint64
	slotted map[*lease]*session // its leases that have a lease table slot, and their session
}

// readableBy reports whether a peer of uid may read e: its owner, root,
// and anyone when e is shared.
func (e *external) readableBy(uid uint32) bool { return e.shared || e.owner == uid || uid == 0 }

func (e *external) info() info {
	return info{
		Name: e.name, Size: e.size, Device: e.device, Sealed: true,
		Shared: e.shared, OwnerUID: e.owner, Created: e.created, Region: e.region, Tensor: e.tensor,
		Leases:   e.leases - idleLeasesLocked(e.slotted),
		External: true, Orphaned: e.state == extOrphaned, ExporterBound: e.legacy != nil, Space: e.space,
		CreatorCanWrite: true, // the memory is the registering process's
	}
}

// register makes files (which it takes, on success and failure alike) or
// r's legacy region readable under r's name.
func (ss *session) register(r *storev1.RegisterRequest, files []*os.File) (info, error) {
	s := ss.s
	ok := false
	defer func() {
		if !ok {
			protocol.CloseFiles(files)
		}
	}()
	// The descriptors staged on this connection come first; the register
	// takes them whatever its outcome.
	attached := len(files)
	files = append(ss.takeStaged(), files...)
	if err := protocol.ValidateRegister(r, attached); err != nil {
		return info{}, err
	}
	if len(files) != int(r.GetFiles()) {
		return info{}, invalidf("register: the request says %d descriptors; %d were staged and attached", r.GetFiles(), len(files))
	}
	e := &external{
		name: r.GetName(), size: int64(r.GetSize()), device: r.GetDevice(), shared: r.GetShared(),
		owner: ss.peer.uid, created: time.Now(), tensor: r.GetTensor(), region: r.GetRegion(),
		space: r.GetSpace(), files: files, registrar: ss,
	}
	if e.device == "host" {
		if err := checkHostMemory(files[0], e.size); err != nil {
			return info{}, err
		}
	} else if err := s.checkGPURegistration(e, files); err != nil {
		return info{}, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if ss.closed {
		return info{}, errSessionClosed
	}
	if err := ss.objectRoomLocked(); err != nil {
		return info{}, err
	}
	if err := s.claimLocked(e.name, e.entry()); err != nil {
		return info{}, err
	}
	if err := s.takeFDsLocked(e.owner, len(files)); err != nil {
		s.unclaimLocked(e.name, e.entry())
		return info{}, err
	}
	ok = true
	s.nextArena++
	e.id = s.nextArena
	ss.registered[e] = struct{}{}
	s.wakeLocked(e.name)
	s.emitLocked(event{kind: eventSealed, name: e.name}, readers(e.owner, e.shared))
	ss.log.Info("external memory registered", "session", ss.id, "name", e.name, "size", e.size, "device", e.device,
		"pieces", len(e.files), "legacy", e.legacy != nil, "shared", e.shared)
	return e.info(), nil
}

// checkGPURegistration checks e's region (GPU memory) against the request
// and its descriptors, and marks a legacy one.
func (s *Store) checkGPURegistration(e *external, files []*os.File) error {
	u, err := cudaipc.ParseUUID(e.device)
	if err != nil {
		return invalidf("register: device %q: memory is named by its GPU's UUID (GPU-…) or is host memory: %v", e.device, err)
	}
	e.device = u.String()
	// Only memory of a GPU the daemon has: another's descriptors would be
	// kept for readers that can do nothing with them.
	if _, err := s.backend.device(e.device); err != nil {
		return fmt.Errorf("register: %w", err)
	}
	reg, err := cudaipc.DecodeRegion(e.region)
	switch {
	case err != nil:
		return invalidf("register: region: %v", err)
	case reg.Size != e.size || reg.Device != u:
		return invalidf("register: the region is %d bytes on %s, the request says %d bytes on %s", reg.Size, reg.Device, e.size, u)
	case reg.Kind == cudaipc.KindCUDAIPC && len(files) != 0:
		return invalidf("register: a cuda-ipc region comes without descriptors, not %d", len(files))
	case reg.Kind == cudaipc.KindVMMFD && len(files) != len(reg.Pieces()):
		return invalidf("register: %d descriptors for a vmm-fd region of %d allocations: send one per piece, first piece first", len(files), len(reg.Pieces()))
	}
	if reg.Kind == cudaipc.KindCUDAIPC {
		e.legacy = e.region
	}
	return nil
}

// checkHostMemory checks that f, registered host memory of size bytes, is
// a memfd of at least that size, and seals it against shrinking: a reader
// maps it, and a shrunk file would fault the reader's loads.
func checkHostMemory(f *os.File, size int64) error {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return fmt.Errorf("register: host memory's descriptor: %w", err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG || st.Size < size {
		return invalidf("register: host memory is a memfd of at least %d bytes; the descriptor is not one (mode %o, %d bytes)", size, st.Mode&unix.S_IFMT, st.Size)
	}
	if _, err := unix.FcntlInt(f.Fd(), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK); err != nil {
		return invalidf("register: host memory's memfd cannot be sealed against shrinking (%v): create it with MFD_ALLOW_SEALING", err)
	}
	return nil
}

// leaseExternalLocked grants a read lease on e: duplicates of its
// descriptors travel with the placement.
func (ss *session) leaseExternalLocked(e *external) (placement, error) {
	p := placement{device: e.device, size: e.size, arenaSize: e.size, external: true, region: e.region, kind: storev1.Placement_VMM_FD}
	switch {
	case e.legacy != nil:
		p.kind = storev1.Placement_CUDA_IPC
	case e.device == "host":
		p.kind = storev1.Placement_HOST
	}
	p.files = len(e.files)
	for _, f := range e.files[:min(len(e.files), protocol.MaxFiles)] {
		d, err := dupFile(f)
		if err != nil {
			p.closeShare()
			return placement{}, fmt.Errorf("duplicating a descriptor of %q: %w", e.name, err)
		}
		p.pieceFiles = append(p.pieceFiles, d)
	}
	l := ss.addLeaseLocked(nil, e)
	ss.slotLocked(l)
	e.leases++
	p.leaseID, p.leaseSlot, p.leaseGen, p.arenaID = l.id, l.slot, l.gen, e.id
	p.info = e.info()
	return p, nil
}

// dupFile duplicates f, close-on-exec.
func dupFile(f *os.File) (*os.File, error) {
	fd, err := unix.FcntlInt(f.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	return os.NewFile(uintptr(fd), f.Name()), nil
}

// registerReply answers a register request. cn.order must not be held.
func (cn *conn) registerReply(id uint64, r *storev1.RegisterRequest, files []*os.File) {
	var err error
	if r.Name, err = cn.qualify(r.Name, true); err != nil {
		protocol.CloseFiles(files)
		cn.reply("register", protocol.ErrorResponse(id, err), nil)
		return
	}
	in, err := cn.ss.register(r, files)
	if err != nil {
		cn.reply("register", protocol.ErrorResponse(id, err), nil)
		return
	}
	cn.reply("register", &storev1.Response{Id: id, Body: &storev1.Response_Register{Register: &storev1.RegisterResponse{Info: in.proto()}}}, nil)
}
