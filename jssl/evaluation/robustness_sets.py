"""ImageNet's robustness test sets for ``linear.extra_test_sets``: which TFDS set is which,
and the classes each one scores.

TFDS labels ImageNet-V2 (``imagenet_v2``), ImageNet-A (``imagenet_a``), ImageNet-R
(``imagenet_r``) and ImageNet-Sketch (``imagenet_sketch``) with ImageNet-1k's label feature
itself (``ClassLabel(names_file=imagenet_common.label_names_file())`` in each builder: the
1000 WordNet ids, sorted), so a head trained on ``imagenet2012`` scores them as they are.
ImageNet-A and ImageNet-R hold 200 of those classes; their standard protocol (Hendrycks et al.
2021, ``natural-adv-examples/eval.py`` ``indices_in_1k``, ``imagenet-r/eval.py``
``imagenet_r_mask``) restricts the logits to those 200 before the arg-max. The 200 WordNet
ids of each are the datasets' own class folders, listed below; their positions come from the
TFDS builder's label names (``class_subset``), never from the labels the data happens to
hold.
"""

from __future__ import annotations

import ml_collections

# ImageNet-A's 200 classes (the synset folders of imagenet-a.tar), sorted.
_IMAGENET_A_WNIDS = """
n01498041 n01531178 n01534433 n01558993 n01580077 n01614925 n01616318 n01631663 n01641577
n01669191 n01677366 n01687978 n01694178 n01698640 n01735189 n01770081 n01770393 n01774750
n01784675 n01819313 n01820546 n01833805 n01843383 n01847000 n01855672 n01882714 n01910747
n01914609 n01924916 n01944390 n01985128 n01986214 n02007558 n02009912 n02037110 n02051845
n02077923 n02085620 n02099601 n02106550 n02106662 n02110958 n02119022 n02123394 n02127052
n02129165 n02133161 n02137549 n02165456 n02174001 n02177972 n02190166 n02206856 n02219486
n02226429 n02231487 n02233338 n02236044 n02259212 n02268443 n02279972 n02280649 n02281787
n02317335 n02325366 n02346627 n02356798 n02361337 n02410509 n02445715 n02454379 n02486410
n02492035 n02504458 n02655020 n02669723 n02672831 n02676566 n02690373 n02701002 n02730930
n02777292 n02782093 n02787622 n02793495 n02797295 n02802426 n02814860 n02815834 n02837789
n02879718 n02883205 n02895154 n02906734 n02948072 n02951358 n02980441 n02992211 n02999410
n03014705 n03026506 n03124043 n03125729 n03187595 n03196217 n03223299 n03250847 n03255030
n03291819 n03325584 n03355925 n03384352 n03388043 n03417042 n03443371 n03444034 n03445924
n03452741 n03483316 n03584829 n03590841 n03594945 n03617480 n03666591 n03670208 n03717622
n03720891 n03721384 n03724870 n03775071 n03788195 n03804744 n03837869 n03840681 n03854065
n03888257 n03891332 n03935335 n03982430 n04019541 n04033901 n04039381 n04067472 n04086273
n04099969 n04118538 n04131690 n04133789 n04141076 n04146614 n04147183 n04179913 n04208210
n04235860 n04252077 n04252225 n04254120 n04270147 n04275548 n04310018 n04317175 n04344873
n04347754 n04355338 n04366367 n04376876 n04389033 n04399382 n04442312 n04456115 n04482393
n04507155 n04509417 n04532670 n04540053 n04554684 n04562935 n04591713 n04606251 n07583066
n07695742 n07697313 n07697537 n07714990 n07718472 n07720875 n07734744 n07749582 n07753592
n07760859 n07768694 n07831146 n09229709 n09246464 n09472597 n09835506 n11879895 n12057211
n12144580 n12267677
""".split()

# ImageNet-R's 200 classes (the synset folders of imagenet-r.tar), sorted.
_IMAGENET_R_WNIDS = """
n01443537 n01484850 n01494475 n01498041 n01514859 n01518878 n01531178 n01534433 n01614925
n01616318 n01630670 n01632777 n01644373 n01677366 n01694178 n01748264 n01770393 n01774750
n01784675 n01806143 n01820546 n01833805 n01843383 n01847000 n01855672 n01860187 n01882714
n01910747 n01944390 n01983481 n01986214 n02007558 n02009912 n02051845 n02056570 n02066245
n02071294 n02077923 n02085620 n02086240 n02088094 n02088238 n02088364 n02088466 n02091032
n02091134 n02092339 n02094433 n02096585 n02097298 n02098286 n02099601 n02099712 n02102318
n02106030 n02106166 n02106550 n02106662 n02108089 n02108915 n02109525 n02110185 n02110341
n02110958 n02112018 n02112137 n02113023 n02113624 n02113799 n02114367 n02117135 n02119022
n02123045 n02128385 n02128757 n02129165 n02129604 n02130308 n02134084 n02138441 n02165456
n02190166 n02206856 n02219486 n02226429 n02233338 n02236044 n02268443 n02279972 n02317335
n02325366 n02346627 n02356798 n02363005 n02364673 n02391049 n02395406 n02398521 n02410509
n02423022 n02437616 n02445715 n02447366 n02480495 n02480855 n02481823 n02483362 n02486410
n02510455 n02526121 n02607072 n02655020 n02672831 n02701002 n02749479 n02769748 n02793495
n02797295 n02802426 n02808440 n02814860 n02823750 n02841315 n02843684 n02883205 n02906734
n02909870 n02939185 n02948072 n02950826 n02951358 n02966193 n02980441 n02992529 n03124170
n03272010 n03345487 n03372029 n03424325 n03452741 n03467068 n03481172 n03494278 n03495258
n03498962 n03594945 n03602883 n03630383 n03649909 n03676483 n03710193 n03773504 n03775071
n03888257 n03930630 n03947888 n04086273 n04118538 n04133789 n04141076 n04146614 n04147183
n04192698 n04254680 n04266014 n04275548 n04310018 n04325704 n04347754 n04389033 n04409515
n04465501 n04487394 n04522168 n04536866 n04552348 n04591713 n07614500 n07693725 n07695742
n07697313 n07697537 n07714571 n07714990 n07718472 n07720875 n07734744 n07742313 n07745940
n07749582 n07753275 n07753592 n07768694 n07873807 n07880968 n07920052 n09472597 n09835506
n10565667 n12267677
""".split()

RESTRICTED = {"imagenet_a": tuple(_IMAGENET_A_WNIDS), "imagenet_r": tuple(_IMAGENET_R_WNIDS)}


def parse(spec: str) -> tuple[str, str]:
    """``"tfds_name:split"`` -> (name, split); the name may carry a config and a version
    (``imagenet_v2/matched-frequency``, ``imagenet_a:0.1.0``), the split a slice."""
    text = spec if isinstance(spec, str) else ""
    cut = text.rfind("[") if text.endswith("]") else len(text)  # a slice holds colons too
    name, sep, split = text[:cut].rpartition(":")
    split += text[cut:]
    if not sep or not name.strip() or not split.strip():
        raise ValueError(
            f"linear.extra_test_sets entry {spec!r} is not 'tfds_name:split'; write e.g. "
            '--config.linear.extra_test_sets=\'("imagenet_v2/matched-frequency:test", '
            '"imagenet_a:test")\'.'
        )
    return name.strip(), split.strip()


def dataset(name: str) -> str:
    """The builder's name without config or version: ``imagenet_v2``."""
    return name.split("/", 1)[0].split(":", 1)[0]


def class_subset(name: str, label_names: list[str] | tuple[str, ...]) -> tuple[int, ...] | None:
    """The label indices a set is scored over, ascending: ImageNet-A's and -R's 200 classes
    located among the builder's ``label_names``; None (every class) for the other sets."""
    wnids = RESTRICTED.get(dataset(name))
    if wnids is None:
        return None
    position = {label: i for i, label in enumerate(label_names)}
    missing = [w for w in wnids if w not in position]
    if missing:
        raise ValueError(
            f"{name}'s label names lack {len(missing)} of its classes (e.g. {missing[0]}): "
            "they are not ImageNet-1k's WordNet ids, so its 200 classes cannot be located."
        )
    return tuple(sorted(position[w] for w in wnids))


def subset_record(name: str, classes: tuple[int, ...] | None, num_classes: int) -> str:
    """How the set's figures are computed, for results.json."""
    if classes is None:
        return f"arg-max over all {num_classes} outputs of the head"
    return (
        f"arg-max over the {len(classes)} outputs of {dataset(name)}'s classes only (its "
        "standard protocol; the class list is the dataset's, located among the TFDS label "
        "names): a prediction outside them is impossible"
    )


def label_names_of(data_config: ml_collections.ConfigDict, split: str) -> tuple[str, ...] | None:
    """The class names of a split of the configured data: TFDS label names, an image folder's
    class folders, the demo's classes; None where the source has none."""
    from jssl.data import demo, sources

    source = sources.resolve_split(data_config, split)
    if source.kind == "folder":  # the training split's class folders label every split
        return source.class_names
    if source.kind == "demo":
        return tuple(demo.CLASS_NAMES)
    label = source.builder.info.features["label"] if source.builder is not None else None
    names = getattr(label, "names", None)
    return tuple(names) if names else None
