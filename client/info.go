package client

import (
	"time"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/protocol"
	"github.com/cudaipc/cudaipc/protocol/storev1"
)

// ObjectInfo describes an object in the store. Its JSON form is what
// 'cudaipc stat --json' prints.
type ObjectInfo struct {
	Name   string `json:"name"`
	Size   int64  `json:"size"`
	Device string `json:"device"` // "host", or a GPU UUID ("GPU-…")
	Sealed bool   `json:"sealed"`
	Leases int    `json:"leases"` // live leases on the object
	Shared bool   `json:"shared"` // readable by every uid the daemon admits
	// Cluster: published in the cluster directory (created with
	// CreateOptions.Cluster, or a replica pulled from another node).
	Cluster  bool      `json:"cluster,omitempty"`
	OwnerUID uint32    `json:"owner_uid"`
	Created  time.Time `json:"created"`
	// Region is the region (docs/region.md) of exactly the object's GPU
	// memory: cuda-ipc, which 'cudaipc dump --region' and CuPy or PyTorch
	// can map, or vmm-fd (a daemon started with --gpu-share fd), which
	// 'cudaipc dump' maps with the descriptor the daemon hands it; nil
	// (JSON null) for host memory. Always present in JSON (the encoding
	// of docs/region.md) so that scripts can test it. Like any region it
	// is a bearer capability for the object's memory.
	Region *cudaipc.Region `json:"region"`

	// Version, Shards and Shard place a shard of a version of a versioned
	// name (omitted for a plain object).
	Version uint64 `json:"version,omitempty"`
	Shards  int    `json:"shards,omitempty"`
	Shard   int    `json:"shard,omitempty"`
	// ManifestSize and Tensors describe a bundle's manifest (omitted for
	// a plain object).
	ManifestSize int64 `json:"manifest_size,omitempty"`
	Tensors      int   `json:"tensors,omitempty"`
	// Tensor is the typed-array descriptor the creator gave
	// (CreateOptions.Tensor), or nil (JSON null) for an untyped object.
	Tensor *TensorDesc `json:"tensor"`

	// External is memory a client registered (Client.Register) rather
	// than an object in the store's arenas; Orphaned says its registering
	// connection is gone (readers' mappings stay valid; the daemon drops
	// it when the last lease ends); ExporterBound says it is a legacy
	// region, removed when its exporter disconnects.
	External      bool `json:"external,omitempty"`
	Orphaned      bool `json:"orphaned,omitempty"`
	ExporterBound bool `json:"exporter_bound,omitempty"`
	// SourcesSize is the sources table of a version published without a
	// copy (PublishNoCopy; Lease.Sources maps it); 0 otherwise.
	SourcesSize int64 `json:"sources_size,omitempty"`

	// CreatorCanWrite says that the bytes of this sealed object may still
	// change through its creator's writable mapping: GPU memory, private
	// host objects, registered memory, and a shared host object until its
	// creator unmapped it. False means the daemon sealed the memory
	// against writes: immutable for everyone (docs/hardening.md, "Sealed
	// objects").
	CreatorCanWrite bool `json:"creator_can_write"`
	// Partial says the lease is of a partial replica: only the tensors a
	// GetBundle named (GetOptions.Tensors), read from another node into
	// an object of their own. Name, Version, Shards and Shard are the
	// bundle's; Size, ManifestSize and Tensors the slice's.
	Partial bool `json:"partial,omitempty"`
	// Space is the description of the KV space registered memory is a
	// region of (RegisterOptions.Space; package kv decodes it), or nil.
	Space []byte `json:"space,omitempty"`
}

// TensorDesc says what an object's bytes are as a typed array, so that
// readers (the Python client's Lease.tensor, NumPy, PyTorch) can view them
// without being told out of band. The daemon checks it against the
// object's size and stores it; it never interprets the bytes.
type TensorDesc struct {
	// DType is the element type: bool, int8, uint8, int16, uint16, int32,
	// uint32, int64, uint64, float16, bfloat16, float32, float64,
	// complex64, complex128, float8_e4m3fn or float8_e5m2.
	DType string `json:"dtype"`
	// Shape is the extent of each dimension (empty: a scalar).
	Shape []int64 `json:"shape"`
	// Strides is the step of each dimension in elements, not bytes; nil
	// means C-contiguous (row-major).
	Strides []int64 `json:"strides,omitempty"`
}

// Event is a change in the store, delivered to subscribers.
type Event struct {
	Kind string // EventSealed, EventDeleted, EventEvicted or EventAborted
	Name string // the object's name
	// Version is the version of a versioned name the event is about: for
	// EventSealed, the version just published (all shards sealed).
	Version uint64
}

// Event kinds.
const (
	EventSealed  = protocol.EventSealed
	EventDeleted = protocol.EventDeleted
	EventEvicted = protocol.EventEvicted
	EventAborted = protocol.EventAborted
)

// ServerInfo is what the daemon said about itself in the handshake.
type ServerInfo struct {
	Version       uint32 // protocol version
	ServerVersion string // daemon build version
	PID           int    // daemon process id
	Backend       string // memory backend, e.g. "host"
	// PeerUID is this client's uid as the daemon sees it: the uid of its
	// objects' qualified names (UID:NAME), by which other uids address them.
	PeerUID uint32
	// Node is the daemon's node name in its cluster, "" for a daemon
	// without one.
	Node string
}

// CreateOptions are the options of Client.Create.
type CreateOptions struct {
	// Device is where the memory lives: "" or "host" for host memory, a
	// GPU UUID ("GPU-…"), or a GPU ordinal ("0", "1", …), which Create
	// resolves to the UUID of this process's GPU of that ordinal. GPU
	// objects need a daemon with the cuda backend.
	Device string
	// Shared makes the sealed object readable by every uid the daemon
	// admits, not only by its creator's uid.
	Shared bool
	// Cluster makes the sealed object cluster-visible: a daemon that is
	// part of a cluster publishes it, and other nodes' daemons pull
	// replicas of it when asked for its name (docs/cluster.md). A daemon
	// without a cluster refuses it.
	Cluster bool
	// NoEvict makes the create fail with ErrStoreFull rather than evict
	// other objects to make room. Create with it while the input may still
	// be rejected (a stream that may turn out longer than size), so that
	// nothing is evicted for bytes that are then not stored.
	NoEvict bool

	// Versioned creates a shard of a version of a versioned name rather
	// than a plain object (Publish sets it); Version, Shards, Shard and
	// KeepLast are for versioned objects only.
	Versioned bool
	// Version is the version to create: 0 means the next one (or, for a
	// sharded version, the oldest pending one still missing Shard, so
	// that N ranks creating "the next version" meet in one).
	Version uint64
	// Shards is how many shards the version has (0 means 1): it becomes
	// visible when all are sealed, and is aborted if the creator of an
	// unsealed shard disconnects. Shard is this object's index.
	Shards, Shard int
	// KeepLast keeps the newest KeepLast visible versions of the name
	// even without leases (0: the name's setting, or the daemon's).
	KeepLast int
	// Manifest is a bundle's manifest (a safetensors header, package
	// bundle), sent beside the object: CreateBundle sets it.
	Manifest []byte
	// Tensor, if set, records what the bytes are as a typed array; its
	// extent must fit in the object's size. Readers find it in
	// ObjectInfo.Tensor.
	Tensor *TensorDesc
}

// GetOptions select, for GetWith, a version of a versioned name and the
// owner the object must have.
type GetOptions struct {
	// Version is the version to get; 0 means the latest visible one.
	Version uint64
	// Shard is the shard of the version to get.
	Shard int
	// NewerThan waits for a version above it (WaitNewer), as Wait does.
	NewerThan uint64
	// Wait makes the get wait, as long as ctx allows, until an object of
	// that name is sealed; when ctx's deadline passes first the error
	// wraps ErrTimeout and context.DeadlineExceeded. Without it a get
	// takes only an object already sealed, and fails at once with
	// ErrNotFound otherwise (objects being written are invisible to
	// readers until sealed, docs/protocol.md).
	Wait bool
	// RequireOwner makes the get succeed only with an object of uid Owner.
	// Each uid has its own namespace (docs/protocol.md, section 6): with a
	// bare name the get then addresses uid Owner's object of that name,
	// and a qualified name ("UID:NAME") of another uid is ErrInvalid. Set
	// it to read a given user's bytes whatever names others choose.
	RequireOwner bool
	// Owner is the uid RequireOwner requires.
	Owner uint32
	// Tensors, for GetBundle, names the tensors wanted: the manifest
	// returned holds only those (sorted by offset, as every manifest), and
	// a name the bundle lacks, or given twice, is ErrInvalid naming it.
	// Where the daemon holds the whole bundle the lease is the whole's;
	// a daemon of a cluster that does not reads only those tensors from
	// another node into a partial replica and leases that
	// (ObjectInfo.Partial: its bytes and ManifestBytes are the slice's;
	// docs/cluster.md, "Partial reads"). GetWith and Get ignore it: their
	// lease is always of the whole object.
	Tensors []string
}

func (t *TensorDesc) proto() *storev1.TensorDesc {
	if t == nil {
		return nil
	}
	return &storev1.TensorDesc{Dtype: t.DType, Shape: t.Shape, Strides: t.Strides}
}

func tensorFromProto(p *storev1.TensorDesc) *TensorDesc {
	if p == nil {
		return nil
	}
	return &TensorDesc{DType: p.GetDtype(), Shape: append([]int64{}, p.GetShape()...), Strides: p.GetStrides()}
}
